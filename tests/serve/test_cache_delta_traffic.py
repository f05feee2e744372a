"""A router catching up with the controller's cache mirrors receives only what changed."""
import asyncio

from raypaged.core.cache_summary import CacheView, SummaryDelta
from raypaged.serve.controller import Controller


def test_a_router_gets_deltas_only_for_workers_whose_cache_changed():
    async def main():
        controller = Controller([("a", None), ("b", None)], probe=None)
        controller._caches["a"].mirror(SummaryDelta(3, (1, 2, 3), full=True))
        controller._caches["b"].mirror(SummaryDelta(1, (9,), full=True))
        router = {}
        for wid, delta in (await controller.cache_deltas({})).items():  # first: everything
            router.setdefault(wid, CacheView()).apply(delta)
        assert {w: v.keys for w, v in router.items()} == {"a": {1, 2, 3}, "b": {9}}
        versions = {w: v.version for w, v in router.items()}
        assert await controller.cache_deltas(versions) == {}  # nothing changed: nothing sent
        controller._caches["b"].mirror(SummaryDelta(2, (5,), (9,)))
        deltas = await controller.cache_deltas(versions)
        assert list(deltas) == ["b"] and deltas["b"].added == (5,) and deltas["b"].removed == (9,)
        # a router that lost its copies (version -1) gets every worker's whole set again
        assert {w: d.full for w, d in (await controller.cache_deltas(
            {"a": -1, "b": -1})).items()} == {"a": True, "b": True}
    asyncio.run(main())
