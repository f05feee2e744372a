"""Iteration-level continuous batching under a per-step token budget.

Each step: running requests first (oldest first; one token for a decode, the next chunk of a
long prompt), then waiting requests FCFS while the budget, max_num_seqs and free blocks allow,
and (headroom admission, core/admission.py) while the running set's projected growth still
fits. When a running request needs a block and none is free, a victim (core/preemption.py) is
preempted by recompute: its blocks are freed and it waits again at its arrival's place, ahead of
everyone who arrived after it.

A scheduled step advances `num_computed_tokens` at once and counts the tokens it will sample as
placeholders, so `schedule()` may run again before the step's result is applied (overlapped
scheduling, see engine_core.py): a request whose last step is still running then gets one more
decode step that feeds a placeholder for the token that step samples. A request whose running
step forks it (n > 1) or surely ends it (max_tokens, max_model_len) waits for that step.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

from raypaged.core.contracts import (PLACEHOLDER, RequestDelta, ScheduledBatch, ScheduledRequest,
                                     StepResult, TokensView)
from raypaged.core.admission import OutputLengths, has_headroom
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.preemption import PreemptionCounters, choose_victim, requeue_by_arrival
from raypaged.core.request import Request, RequestStatus
from raypaged.core.request_queue import RequestQueue
from raypaged.core.scheduling_policy import SchedulingPolicy


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, policy: SchedulingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """clock: seconds, for the time requests spend preempted (a simulator passes its own)."""
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.policy = policy or SchedulingPolicy()
        self.preemption = PreemptionCounters(clock)
        self.output_lengths = OutputLengths()  # projects open max_tokens (headroom admission)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = RequestQueue()  # O(1) abort at any queue length
        # Requests added but not yet schedulable: they wait for something outside core (the
        # compile of their grammar, model/grammar.py) and join `waiting` at their arrival's
        # place on release(), so a slow compile holds back only its own request.
        self.held: dict[str, Request] = {}
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        self.children: dict[str, list[str]] = {}  # n > 1: parent id -> forked ids
        # Waiting requests the last schedule() could not admit for lack of KV blocks or seats (0
        # when only the step's token budget stopped it); serving bounds its queue by this.
        self.num_blocked = 0
        self._left: set[str] = set()  # left the running set since the last batch (runner drops state)
        self._arrivals = itertools.count()
        # id(batch) -> its requests and their preemption counts, until update(batch): a request
        # finished or preempted since it was scheduled gets nothing from that step
        self._scheduled_reqs: dict[int, list[tuple[Request, int]]] = {}
        self.num_preemptions = 0
        self.num_finished = 0
        # tokens still to be fed (num_tokens + num_placeholders - num_computed_tokens) over
        # waiting and running requests, kept at every transition: routers read it every poll
        self.num_queued_tokens = 0
        # queue tokens computed (prompt and recompute; a decode's newest token refills the queue
        # as it drains it): how fast the queue shrinks, for TTFT prediction (core/ttft_slo.py)
        self.num_prefill_tokens = 0

    # -- requests in and out -----------------------------------------------------------------
    def add(self, request: Request, held: bool = False) -> None:
        """Queue a request (raises ValueError, nothing queued, if it can never be served);
        `held`: checked and counted now, but not scheduled until release(request_id)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # core's one length check (the serving edge answers 400 before a request gets here)
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt is {request.num_prompt_tokens} tokens but max_model_len is "
                f"{self.max_model_len}: shorten the prompt to at most {self.max_model_len - 1} "
                "tokens")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"request needs {total} ({request.num_prompt_tokens} in the prompt, "
                f"{request.max_tokens} max_tokens): shorten the prompt or lower max_tokens")
        if request.sampling.n > self.max_num_seqs:  # its samples are admitted together
            raise ValueError(
                f"the request asks for n = {request.sampling.n} samples but max_num_seqs is "
                f"{self.max_num_seqs}: lower n or raise max_num_seqs")
        need = -(-(total - 1) // self.block_size)  # the last sampled token is never fed back
        if need > self.kv.pool.num_blocks:
            fits = self.kv.pool.num_blocks * self.block_size
            raise ValueError(
                f"the request needs {need} KV blocks ({total} tokens) but the whole pool has "
                f"{self.kv.pool.num_blocks} ({fits} tokens): keep prompt + max_tokens <= "
                f"{fits + 1} or raise the KV budget")
        request.arrival = next(self._arrivals)
        self.requests[request.request_id] = request
        if held:
            self.held[request.request_id] = request
        else:
            self.waiting.append(request)
        self.num_queued_tokens += request.num_tokens - request.num_computed_tokens

    def release(self, request_id: str) -> None:
        """A held request may be scheduled from now on, ahead of those that arrived after it.
        An id not held (aborted meanwhile, or never held) is ignored."""
        req = self.held.pop(request_id, None)
        if req is not None:
            requeue_by_arrival(self.waiting, req)

    def abort(self, request_id: str, reason: str = "abort", with_samples: bool = True) -> list[Request]:
        """Finish a request in any state, with its forked samples unless told otherwise (a stop
        string ends one sample only); returns the sequences finished."""
        ids = [request_id, *(self.children.get(request_id, ()) if with_samples else ())]
        done = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)  # O(max_num_seqs), whatever the queue's length
            elif self.held.pop(rid, None) is None:
                self.waiting.remove(req)
            self._finish(req, reason)
            done.append(req)
        return done

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.num_queued_tokens -= req.num_tokens + req.num_placeholders - req.num_computed_tokens
        req.num_placeholders = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.kv.free(req)
        self._left.add(req.request_id)
        del self.requests[req.request_id]
        self.num_finished += 1
        self.preemption.finished(req)
        if reason not in ("abort", "error"):  # lengths outputs ended at by themselves
            self.output_lengths.record(req.num_output_tokens)
        # Keep a group's child list until every sample is done, so abort(parent) still reaches them.
        group = req.parent_id or req.request_id
        kids = self.children.get(group)
        if kids is not None and group not in self.requests and not any(k in self.requests for k in kids):
            del self.children[group]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_placeholders and (not req.forked or self._surely_ends(req)):
                i += 1  # its running step forks it or ends it: schedule it after that step
                continue
            n = min(req.num_tokens + req.num_placeholders - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                j = self._victim(chosen)
                victim = self.running.pop(j)
                i -= j < i
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                chosen.append((req, n))
                budget -= n
                i += 1

        seats = len(self.running) + sum(r.sampling.n - 1 for r in self.running if not r.forked)
        blocked = preempted  # the queue waits for KV blocks or seats, not for this step's budget
        while self.waiting and budget > 0 and not preempted:
            req = self.waiting[0]
            need_seats = 1 if req.forked else req.sampling.n
            if seats + need_seats > self.max_num_seqs:
                blocked = True
                break
            hits = self.kv.find_cached_prefix(req) if self.kv.pool.enable_caching else []
            n = min(req.num_tokens - len(hits) * self.block_size, budget)
            if (self.policy.headroom and self.running
                    and not has_headroom(self.running, req, self.kv, self.output_lengths, self.policy)
                    or not self.kv.allocate(req, n, hits)):
                blocked = True
                break  # FCFS: nobody overtakes the head of the queue
            self.num_queued_tokens -= len(hits) * self.block_size  # the prefix hit
            self.waiting.popleft()
            self.preemption.resumed(req)
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(hits) * self.block_size
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
            seats += need_seats

        self.num_blocked = len(self.waiting) if blocked else 0
        batch = ScheduledBatch(
            requests=tuple(self._scheduled(req, n) for req, n in chosen),
            block_copies=tuple(self.kv.pending_copies),
            finished_request_ids=frozenset(self._left),
        )
        self.kv.pending_copies = []
        if chosen:  # a batch without requests never reaches the runner: the next one tells it
            self._left = set()
            self._scheduled_reqs[id(batch)] = [(req, req.num_preemptions) for req, _ in chosen]
        return batch

    def _victim(self, chosen: list[tuple[Request, int]]) -> int:
        """Index in self.running of the request to preempt; never one this step has already
        scheduled (its share of the step is in the batch)."""
        if not self.policy.bounded:
            return len(self.running) - 1  # the newest; those already scheduled are older
        scheduled = {req.request_id for req, _ in chosen}
        candidates = [r for r in self.running if r.request_id not in scheduled]
        return self.running.index(choose_victim(candidates, self.policy.protect_after_preemptions))

    def _surely_ends(self, req: Request) -> bool:
        """Whether the tokens its scheduled steps sample end it by length, whatever they are."""
        return (req.num_output_tokens + req.num_placeholders >= req.max_tokens
                or req.num_tokens + req.num_placeholders >= self.max_model_len)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        """The step's share for req; marks its n tokens computed and its samples as placeholders."""
        start = req.num_computed_tokens
        known = req.all_token_ids[start:start + n]
        unknown = n - len(known)  # placeholders: sampled by the step still running
        reaches_end = start + n == req.num_tokens + req.num_placeholders
        num_samples = (req.sampling.n if not req.forked else 1) if reaches_end else 0
        sr = ScheduledRequest(
            request_id=req.request_id,
            token_ids=known + [PLACEHOLDER] * unknown,
            start_position=start,
            block_table=self.kv.block_ids[req.request_id],
            num_samples=num_samples,
            sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids,
            # frozen length: core may append while the step runs
            output_token_ids=TokensView(req.output_token_ids, req.num_output_tokens),
            sample_index=req.sample_index,
            eos_token_id=req.eos_token_id,
            num_placeholders=unknown,
        )
        self.preemption.scheduled(req, start, n)
        req.num_computed_tokens += n
        req.num_placeholders += num_samples
        self.num_queued_tokens += num_samples - n
        self.num_prefill_tokens += max(0, n - num_samples)
        return sr

    def _preempt(self, req: Request) -> None:
        self.preemption.preempted(req)
        self.kv.free(req)
        # recomputed from the start; a running step's sample for it is dropped
        self.num_queued_tokens += req.num_computed_tokens - req.num_placeholders
        req.num_computed_tokens = req.num_placeholders = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._left.add(req.request_id)
        if self.policy.bounded:
            requeue_by_arrival(self.waiting, req)
        else:
            self.waiting.appendleft(req)

    # -- apply the runner's result -----------------------------------------------------------
    def update(self, batch: ScheduledBatch, result: StepResult) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        for sr, (req, preemptions) in zip(batch.requests, self._scheduled_reqs.pop(id(batch))):
            if req.is_finished or req.num_preemptions != preemptions:
                continue  # aborted, stopped or preempted since this step was scheduled
            self.kv.cache_full_blocks(req, sr.start_position + len(sr.token_ids))
            if sr.num_samples == 0:
                continue
            tokens = result.sampled[sr.request_id]
            logprobs = result.logprobs.get(sr.request_id, ())
            # placeholders -> tokens: the queued count is unchanged (forked samples feed theirs)
            req.num_placeholders -= len(tokens)
            seqs = [req] if len(tokens) == 1 else [req, *self._fork(req, len(tokens))]
            for k, (seq, token) in enumerate(zip(seqs, tokens)):
                seq.append_token(token)
                self._check_stop(seq, token)
                deltas.append(RequestDelta(
                    request_id=seq.request_id, new_token_ids=(token,),
                    finish_reason=seq.finish_reason,
                    new_logprobs=(logprobs[k],) if k < len(logprobs) else (),
                    num_cached_tokens=seq.num_cached_tokens, parent_id=seq.parent_id,
                    sample_index=seq.sample_index, stop_reason=seq.stop_reason))
        self.running = [r for r in self.running if not r.is_finished]
        return deltas

    def _fork(self, parent: Request, n: int) -> list[Request]:
        """n > 1: the prompt is done; n - 1 children share its blocks (copy-on-write later)."""
        parent.forked = True
        kids = []
        for i in range(1, n):
            child = Request(f"{parent.request_id}#{i}", parent.prompt_token_ids, parent.sampling,
                            parent.max_tokens, parent.eos_token_id, parent.cache_salt,
                            parent_id=parent.request_id, sample_index=i,
                            arrival=parent.arrival)
            child.forked = True
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv.fork(parent, child)
            self.requests[child.request_id] = child
            self.running.append(child)
            kids.append(child)
        self.children[parent.request_id] = [k.request_id for k in kids]
        return kids

    def _check_stop(self, req: Request, token: int) -> None:
        sp = req.sampling
        past_min = req.num_output_tokens > sp.min_tokens
        if past_min and token in sp.stop_token_set:
            self._finish(req, "stop", token)
        elif past_min and not sp.ignore_eos and token == req.eos_token_id:
            self._finish(req, "stop")
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, "length")
