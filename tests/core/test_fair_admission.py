"""FairAdmission: what is sent at once, the round robin over clients for the rest, O(1) leave."""
from __future__ import annotations

from raypaged.core.fair_admission import FairAdmission, blocks_needed


def admitted(tickets) -> list[str]:
    return [f"{t.client}{t.blocks}" for t in tickets]


def test_blocks_needed_counts_the_prompt_once_and_each_samples_output():
    assert blocks_needed(200, 40, 1, 16, 256) == 13 + 3
    assert blocks_needed(200, 40, 4, 16, 256) == 13 + 4 * 3
    assert blocks_needed(200, None, 1, 16, 256) == 13 + 4  # unset: the rest of max_model_len
    assert blocks_needed(200, None, 1, 16, 4096, open_output=40) == 13 + 3  # the mean seen
    assert blocks_needed(200, None, 1, 16, 256, open_output=400) == 13 + 4  # at most the rest


def test_requests_that_fit_go_at_once_and_the_rest_wait():
    fa = FairAdmission()
    fa.set_capacity(10)
    a = [fa.arrive("a", 4) for _ in range(3)]
    assert [t.admitted for t in a] == [True, True, False]
    assert (fa.num_admitted, fa.admitted_blocks, fa.in_flight["a"]) == (2, 8, 3)


def test_the_waiting_are_released_round_robin_over_clients_not_in_arrival_order():
    fa = FairAdmission()
    fa.set_capacity(2)
    first = [fa.arrive("a", 1), fa.arrive("a", 1)]
    # a floods first; b and c come later, one request each, then b a second one
    for client in "aaaa":
        fa.arrive(client, 1)
    fa.arrive("b", 2)   # sizes tell the tickets apart below
    fa.arrive("c", 3)
    fa.arrive("b", 4)
    assert admitted(fa.leave(first[0])) == ["a1"]  # a's turn: it was the first to wait
    # room for everyone at once: the order of release is the rotation
    assert admitted(fa.set_capacity(100)) == ["b2", "c3", "a1", "b4", "a1", "a1"]
    assert fa.num_admitted == 8


def test_a_request_that_does_not_fit_is_overtaken_by_share_only_never_by_room():
    fa = FairAdmission()
    fa.set_capacity(10)
    big = fa.arrive("a", 8)
    huge = fa.arrive("b", 6)   # fits nowhere beside big, and over b's share (10 // 2)
    more = fa.arrive("a", 1)   # would fit, but b's waits ahead, and a is over its share
    small = fa.arrive("c", 1)  # within c's share (10 // 3): goes at once
    assert [t.admitted for t in (big, huge, more, small)] == [True, False, False, True]
    assert admitted(fa.leave(big)) == ["b6", "a1"]


def test_a_flood_alone_fills_7_8_of_the_cache_and_a_newcomer_starts_at_once_in_the_rest():
    fa = FairAdmission()
    fa.set_capacity(100)
    flood = [fa.arrive("f", 20) for _ in range(10)]
    assert sum(t.admitted for t in flood) == 4  # a fifth would hold 100 > 100 - 100 // 8
    assert fa.arrive("p", 2).admitted and fa.admitted_blocks == 82
    assert fa.arrive("big", 90).admitted is False  # a client's only request may exceed 7/8...
    assert admitted(fa.leave(flood[0])) == ["f20"]  # the flood's turn came first: it refills
    for t in flood[1:4]:
        assert fa.leave(t) == []  # big's turn now: nobody passes it by room
    # once it fits it goes; the flood, now under its share (100 // 3), goes beside it
    assert admitted(fa.leave(flood[4])) == ["big90", "f20"]


def test_a_newcomer_within_its_share_goes_at_once_even_over_a_full_cache():
    fa = FairAdmission()
    fa.set_capacity(100)
    flood = [fa.arrive("f", 20) for _ in range(10)]  # 4 admitted: 80
    other = fa.arrive("g", 20)                        # fits: 100
    probe = fa.arrive("p", 2)  # no room, but within its share (100 // 3): overcommitted
    assert other.admitted and probe.admitted and fa.admitted_blocks == 102
    # the flood, over its share, gets nothing more until its requests fit again
    assert fa.leave(flood[0]) == []
    assert admitted(fa.leave(flood[1])) == ["f20"]
    assert (fa.blocks_of["f"], fa.blocks_of["g"], fa.blocks_of["p"]) == (60, 20, 2)


def test_with_nothing_admitted_a_request_larger_than_the_cache_still_goes():
    fa = FairAdmission()
    fa.set_capacity(10)
    assert fa.arrive("a", 50).admitted


def test_a_waiting_request_that_leaves_gives_its_place_up():
    fa = FairAdmission()
    fa.set_capacity(1)
    running = fa.arrive("a", 1)
    gone, stays = fa.arrive("b", 1), fa.arrive("c", 1)  # shares of 1 // 2, 1 // 3: none
    assert fa.leave(gone) == []          # nothing freed: nobody released
    assert "b" not in fa.in_flight and "b" not in fa._waiting
    assert fa.leave(running) == [stays]


def test_no_capacity_means_no_bound_and_the_cap_counts_waiting_and_admitted():
    fa = FairAdmission(max_per_client=3)
    tickets = [fa.arrive("a", 1000) for _ in range(3)]
    assert all(t.admitted for t in tickets)
    assert fa.over_cap("a") and not fa.over_cap("b")
    fa.leave(tickets[0])
    assert not fa.over_cap("a")
    assert not FairAdmission(max_per_client=0).over_cap("a")  # 0: no cap
