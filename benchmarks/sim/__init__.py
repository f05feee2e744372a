"""A discrete-event fleet simulator that runs raypaged's own code: each simulated worker is the
real Scheduler + KVCacheManager + BlockPool (worker.py) with a step-time cost model
(cost_model.py), the router is the serving Router on lagged snapshots (fleet.py, policies.py),
and the traffic is a trace or a synthetic workload (trace.py). Pure Python: no torch, no ray.
"""
