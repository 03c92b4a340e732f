"""A ResNet-18-shaped network written with dtorch.nn against the same network in torch.nn (written here:
torchvision's layout, BasicBlock x [2, 2, 2, 2], 7x7/2 stem, 3x3/2 max pool, global average pool, fc), same
weights, float32, at 1e-4: training-mode forward (batch statistics, running statistics updated in place),
eval forward, and a backward spot check of a few parameter gradients. Reduced widths (8, 16, 32, 64
channels instead of 64..512), 32x32 inputs, batch 4, 10 classes: small and fast.

Layouts: dp=2 x tp=2 (batch sharded on dp; each block's first conv column-parallel on tp (output channels
sharded), its second row-parallel (Partial output, reduced by the batch norm)), and spatial sharding (H on
a mesh dim: halo exchanges in every 3x3 conv and the max pool, the global pool gives Partial(sum)), with
dp x sp and with sp=4 (the deepest layers' 2x2 and 1x1 maps are too small for four devices: those convs
gather H, the fallback)."""
from __future__ import annotations

import pytest
import torch

import dtorch
import dtorch.nn as dnn
from dtorch import Shard

WIDTHS = (8, 16, 32, 64)
TOL = {"rtol": 1e-4, "atol": 1e-4}


# -- the torch reference --------------------------------------------------------------------------------

class TBlock(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                  torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class TResNet18(torch.nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, WIDTHS[0], 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(WIDTHS[0])
        self.maxpool = torch.nn.MaxPool2d(3, 2, 1)
        cin = WIDTHS[0]
        for i, (w, s) in enumerate(zip(WIDTHS, (1, 2, 2, 2))):
            setattr(self, f"layer{i + 1}", torch.nn.Sequential(TBlock(cin, w, s), TBlock(w, w, 1)))
            cin = w
        self.avgpool = torch.nn.AdaptiveAvgPool2d((1, 1))
        self.fc = torch.nn.Linear(WIDTHS[-1], classes)

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- the same network in dtorch.nn ------------------------------------------------------------------------

class Block(dnn.Module):
    def __init__(self, cin, cout, stride, mesh):
        super().__init__()
        # Megatron's pairing on tp: output channels split, then input channels split (Partial, reduced in bn2)
        self.conv1 = dnn.Conv2d(cin, cout, 3, stride, 1, bias=False, device_mesh=mesh, tp_shard_type="col")
        self.bn1 = dnn.BatchNorm2d(cout, device_mesh=mesh)
        self.conv2 = dnn.Conv2d(cout, cout, 3, 1, 1, bias=False, device_mesh=mesh, tp_shard_type="row")
        self.bn2 = dnn.BatchNorm2d(cout, device_mesh=mesh)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = dnn.Sequential(dnn.Conv2d(cin, cout, 1, stride, bias=False, device_mesh=mesh),
                                             dnn.BatchNorm2d(cout, device_mesh=mesh))

    def forward(self, x):
        out = dnn.functional.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return dnn.functional.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(dnn.Module):
    def __init__(self, mesh, classes=10):
        super().__init__()
        self.conv1 = dnn.Conv2d(3, WIDTHS[0], 7, 2, 3, bias=False, device_mesh=mesh)
        self.bn1 = dnn.BatchNorm2d(WIDTHS[0], device_mesh=mesh)
        self.maxpool = dnn.MaxPool2d(3, 2, 1)
        cin = WIDTHS[0]
        for i, (w, s) in enumerate(zip(WIDTHS, (1, 2, 2, 2))):
            setattr(self, f"layer{i + 1}", dnn.Sequential(Block(cin, w, s, mesh), Block(w, w, 1, mesh)))
            cin = w
        self.avgpool = dnn.AdaptiveAvgPool2d((1, 1))
        self.flatten = dnn.Flatten()
        self.fc = dnn.Linear(WIDTHS[-1], classes, device_mesh=mesh)

    def forward(self, x):
        x = self.maxpool(dnn.functional.relu(self.bn1(self.conv1(x))))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(self.flatten(self.avgpool(x)))


LAYOUTS = {
    "dp2xtp2": ((2, 2), ["dp", "tp"], [Shard(0), dtorch.Replicate()]),
    "dp2xsp2": ((2, 2), ["dp", "sp"], [Shard(0), Shard(2)]),
    "sp4": ((4,), ["sp"], [Shard(2)]),
}
SPOT = ["conv1.weight", "bn1.weight", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
        "layer3.1.conv2.weight", "layer4.1.bn2.bias", "fc.weight"]


_CASES = [pytest.param(layout, dtype, id=f"{layout}-{str(dtype)[-2:]}",
                        marks=() if dtype == torch.float32 and layout != "sp4" else pytest.mark.slow)
          for layout in LAYOUTS for dtype in (torch.float32, torch.float64)]


@pytest.mark.parametrize("layout,dtype", _CASES)
def test_resnet18_matches_torch(layout, dtype):
    """float32: values at 1e-4, the spot-checked gradients at 1e-4 of their largest entry (18 batch norms over
    4 samples amplify rounding differences); float64: every gradient at 1e-9."""
    shape, names, x_pl = LAYOUTS[layout]
    mesh = dtorch.init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    ref = TResNet18().to(dtype)
    with dnn.skip_init(), dtorch.Graph.default_graph().dtype_guard(dtype):
        model = ResNet18(mesh)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)
    labels = torch.tensor([1, 7, 3, 0])

    # training mode: batch statistics, running statistics updated, gradients
    expected = ref(x)
    torch.nn.functional.cross_entropy(expected, labels).backward()
    dx = dtorch.Tensor(x, device_mesh=mesh, placements=x_pl)
    with dtorch.CommLog() as log:
        out = model(dx)
    torch.testing.assert_close(out.to_torch(), expected.detach(), **TOL)
    if "sp" in names:  # spatial shards: halo exchanges, never a gather of the activations in the stem
        kinds = [r.kind for r in log.records if r.mesh_dim == "sp"]
        assert kinds[:2] == ["send_recv", "send_recv"], kinds[:4]
    loss = dtorch.nn.functional.cross_entropy(out, dtorch.Tensor(labels, device_mesh=mesh))
    loss.backward()
    params = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())
    for name in SPOT if dtype == torch.float32 else list(ref_params):
        want = ref_params[name].grad
        tol = {"rtol": 1e-4, "atol": 1e-4 * float(want.abs().max())} if dtype == torch.float32 else \
            {"rtol": 1e-9, "atol": 1e-9}
        torch.testing.assert_close(params[name].grad.to_torch(), want, **tol,
                                   msg=lambda m: f"{layout} grad {name}: {m}")
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for name in ("bn1.running_mean", "bn1.running_var", "layer3.0.bn2.running_var", "layer4.1.bn1.running_mean",
                 "bn1.num_batches_tracked"):
        torch.testing.assert_close(sd[name], ref_sd[name], **TOL, msg=lambda m: f"{layout} {name}: {m}")

    # eval mode: running statistics
    model.eval()
    ref.eval()
    with torch.no_grad(), dtorch.no_grad():
        torch.testing.assert_close(model(dx).to_torch(), ref(x), **TOL)
