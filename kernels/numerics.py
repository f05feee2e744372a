"""Numeric constants shared by the kernels, their references and the torch backend."""
import math

FP8_E4M3_MAX = 448.0            # largest finite float8_e4m3fn value; the format has no infinity
LOG2E = 1 / math.log(2)         # softmax runs on exp2: exp(x) = exp2(x * LOG2E)
