"""The sampler's noise: uniforms strictly inside (0, 1), so a token the masks removed (logit
-inf, probability 0) is never drawn."""
import torch

from raypaged.core.sampling_params import SamplingParams
from raypaged.model.sampler import unit_interval
from raypaged.model.sampler import SampleRow, Sampler


def test_every_32_bit_value_maps_strictly_inside_the_unit_interval():
    top = torch.arange((1 << 32) - (1 << 16), 1 << 32, dtype=torch.int64)  # all that round up
    u = unit_interval(torch.cat([torch.arange(1 << 16, dtype=torch.int64), top]))
    assert u.min().item() == 0.5 / (1 << 23) and u.max().item() == 1 - 0.5 / (1 << 23)
    assert (u > 0).all() and (u < 1).all()


def test_a_masked_token_is_never_drawn_over_thousands_of_seeded_rows():
    # 49,152 entries (the default model's vocabulary), two allowed: the old noise made u = 1.0
    # (q = 0, 0/0 = NaN, which argmax takes) about once every 340 rows
    vocab, allowed = 49152, [17, 40000]
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, allowed] = torch.tensor([0.3, -0.2])
    rows = [SampleRow(SamplingParams(temperature=0.7, seed=s), [1], [0] * k, 0, None)
            for s in range(100) for k in range(30)]
    tokens, _ = Sampler()(logits.expand(len(rows), vocab).contiguous(), rows)
    assert set(tokens) == set(allowed)
