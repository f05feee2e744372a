"""Ahead-of-time builds of every Triton kernel variant for NVIDIA targets, on a machine without a
GPU: record the variants the launchers would compile (aot_capture), compile them for sm_80/89/90
(aot_build), and check each against the engine's own refusals (compile_check). Tools for tests
and benchmarks; the library never imports them."""
