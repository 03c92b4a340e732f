"""runtime/tapes.py: what a kept local graph lets go of."""
import torch

from dtorch.runtime.tapes import RELEASE_NUMEL, drop_output_values


def _leaves():
    g = torch.Generator().manual_seed(0)
    # a GEMM result of RELEASE_NUMEL elements: big enough to be let go of
    x = torch.randn(RELEASE_NUMEL // 128, 96, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(96, 128, generator=g, dtype=torch.float64).requires_grad_()
    return x, w


def _grads(outs, leaves, cts):
    return torch.autograd.grad(outs, leaves, cts)


def test_a_view_output_lets_its_gemm_result_go_and_differentiates_the_same():
    x, w = _leaves()
    ref = (x @ w).reshape(-1, 8, 128)
    ct = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(1))
    expected = _grads([ref], [x, w], [ct])

    y = (x @ w).reshape(-1, 8, 128)
    base = y._base
    assert base is not None and base.untyped_storage().nbytes() == RELEASE_NUMEL * 8
    drop_output_values([y])
    # the view's base (the GEMM's result, saved by nothing) holds one element now, not the result
    assert base.untyped_storage().nbytes() == 8 and y.untyped_storage().nbytes() == 8
    for got, want in zip(_grads([y], [x, w], [ct]), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_base_the_graph_saved_keeps_its_values():
    def kernel(x, w):
        c = x @ w
        return c.reshape(-1), c.sin()  # sin saves c: the base of the first output

    x, w = _leaves()
    refs = kernel(x, w)
    cts = [torch.randn(r.shape, dtype=r.dtype, generator=torch.Generator().manual_seed(k)) for k, r in enumerate(refs)]
    expected = _grads(list(refs), [x, w], cts)

    outs = kernel(x, w)
    base = outs[0]._base
    drop_output_values(outs)
    assert base.untyped_storage().nbytes() == RELEASE_NUMEL * 8  # kept: sin's backward reads it
    for got, want in zip(_grads(list(outs), [x, w], cts), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
