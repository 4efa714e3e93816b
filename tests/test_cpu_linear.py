"""CpuLinear: a few rows as W @ x.T on the CPU backend (macinfer.modelio.cpu_linear)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from macinfer.modelio import cpu_linear
from macinfer.modelio.cpu_linear import CpuLinear, use_cpu_linears


def _pair(n_in: int, n_out: int, bias: bool):
    mx.random.seed(3)
    ref = nn.Linear(n_in, n_out, bias=bias)
    mine = nn.Linear(n_in, n_out, bias=bias)
    mine.update(ref.parameters())
    mine.__class__ = CpuLinear
    return ref, mine


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (1, 4), (4, 1), (1, 5), (3, 3), (1, 9)])
def test_same_products_as_nn_linear(shape, bias):
    ref, mine = _pair(96, 80, bias)
    x = mx.random.normal((*shape, 96))
    a, b = ref(x), mine(x)
    assert b.shape == a.shape == (*shape, 80)
    rows = shape[0] * shape[1]
    if cpu_linear.ROWS[0] <= rows <= cpu_linear.ROWS[1]:
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()
        # The other form really ran: computed as W @ x.T it equals that exactly.
        w = ref.weight
        want = (w @ x.reshape(rows, 96).T).T.reshape(a.shape)
        if bias:
            want = mx.addmm(ref.bias[:, None], w, x.reshape(rows, 96).T).T.reshape(a.shape)
        assert mx.array_equal(b, want).item()
    else:  # one row (a decode step) and wide products: nn.Linear's own computation, bit for bit
        assert mx.array_equal(a, b).item()


def test_large_weights_keep_nn_linear(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MAX_WEIGHT", 64 * 64 - 1)
    ref, mine = _pair(64, 64, False)
    x = mx.random.normal((1, 3, 64))
    assert mx.array_equal(ref(x), mine(x)).item()


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(64, 64)
        self.layers = [nn.Linear(64, 32, bias=False), nn.Linear(32, 64)]
        self.quant = nn.QuantizedLinear(64, 64, bits=4, group_size=32)

        class Own(nn.Linear):  # a model's own subclass keeps its __call__
            pass

        self.own = Own(64, 64)


def test_swaps_exactly_the_float_linears():
    m = _Mixed()
    assert use_cpu_linears(m) == 3
    assert type(m.plain) is CpuLinear and all(type(l) is CpuLinear for l in m.layers)
    assert type(m.quant) is nn.QuantizedLinear and type(m.own).__name__ == "Own"
    assert use_cpu_linears(m) == 0  # already swapped


def test_nothing_on_metal(monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    m = _Mixed()
    assert use_cpu_linears(m) == 0 and type(m.plain) is nn.Linear


def test_models_load_with_it_here():
    from macinfer.modelio.loader import load_model

    if mx.metal.is_available():
        pytest.skip("Metal: the layers stay nn.Linear")
    model, _, _ = load_model(None)
    kinds = {type(m) for _, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {CpuLinear}


def test_drafts_load_with_it_here():
    """The shipped feature draft (one decoder layer and its fc) loads with CpuLinear layers too."""
    from macinfer.modelio.loader import load_model
    from macinfer.spec_decode.draft_model import load_draft

    if mx.metal.is_available():
        pytest.skip("Metal: the layers stay nn.Linear")
    model, tok, _ = load_model(None)
    draft = load_draft("smollm2-135m", model, tok)
    kinds = {type(m) for _, m in draft.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {CpuLinear}
