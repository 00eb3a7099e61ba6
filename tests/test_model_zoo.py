"""Models nobody here wrote train under the default options as in one process (``model_zoo.py``).

``fsdp_compile.backend("FULL_SHARD")`` with nothing else (Inductor, regions, scheduling) at
world 2, three SGD steps, against one process training the same model on the same data: the
loss of every step, and the first step's gradients relative to the model's largest gradient (an
attention key bias has a gradient that is zero in exact arithmetic and ~1e-11 in practice, so a
per-tensor relative error means nothing there). The reference takes each rank's batch as a
separate forward and averages the losses, which is what data parallelism computes (BatchNorm
normalizes each rank's batch by its own statistics).

Each model also shows what happened to its blocks, read from the compiled graphs: regions where
torch allows them, and otherwise the one warning naming the class compiled inline.

Every strategy on the default compiler is in the default run elsewhere (test_model_shapes.py);
here the default run holds one model of each way regions can go, the rest run with -m slow.

transformers is in the test extra: without it the Hugging Face cases fail on its import. A case
skips only where the installed transformers lacks a class it builds, and the skip names it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from helpers import compiled_regions, full
from model_zoo import SEQ, VOCAB, ZOO, HFModel, build, loss_of

import fsdp_compile
from fsdp_compile.sharding.compile_regions import regions_supported

WORLD = 2
PER_RANK = 2
STEPS = 3
LR = 0.1
# Losses: Inductor's fused kernels round differently from eager ops (observed <= 2e-6 here).
LOSS_RTOL = 1e-4
# First-step gradients, against the model's largest gradient: observed <= 2e-6.
GRAD_RTOL = 1e-4
# One of each way a model's blocks can go under the defaults: regions (Llama), regions kept by
# construction (T5 hands its position bias on), inline after Dynamo refused (Mistral's KV
# cache, an in-place buffer update, a graph break), inline from the captured graph (BatchNorm).
DEFAULT_RUN = ("llama", "t5", "mistral", "batchnorm_block", "buffer_update_block", "graph_break_block")


def _missing_classes(name: str) -> list[str]:
    """The transformers classes ``name`` needs that the installed transformers lacks. A missing
    transformers is not a skip: the import fails the test (it is in the test extra)."""
    make = ZOO[name].make
    if not isinstance(make, HFModel):
        return []
    import transformers

    return [cls for cls in make.classes() if not hasattr(transformers, cls)]


def _batches(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, WORLD, PER_RANK, SEQ), generator=torch.Generator().manual_seed(seed))


def zoo_worker(rank: int, world: int, name: str) -> dict:
    torch.manual_seed(0)
    base = build(name)
    data = _batches()
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend("FULL_SHARD")
    backend.shard(model)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            loss = loss_of(name, compiled, data[step, rank])
            loss.backward()
            if step == 0:
                grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
    out = {"losses": losses, "grads": grads, "region_calls": compiled_regions(backend)[0],
           "inlined": {c.name: c.reason for c in backend._state.region_fallback.inlined()},
           "warnings": [str(w.message) for w in caught if "region" in str(w.message)],
           "buffers": {n: b.clone() for n, b in model.named_buffers() if n.endswith("calls")}}
    if rank == 0:
        out["reference"] = _reference(name, base, data, world)
    return out


def _reference(name: str, base: torch.nn.Module, data: torch.Tensor, world: int) -> dict:
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        loss = sum(loss_of(name, model, data[step, r]) for r in range(world)) / world
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def _case(name: str):
    marks = () if name in DEFAULT_RUN else (pytest.mark.slow,)
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_case(n) for n in ZOO])
def test_default_options_train_like_one_process(name: str) -> None:
    missing = _missing_classes(name)
    if missing:
        import transformers

        pytest.skip(f"{name}: {', '.join(missing)} not in the installed transformers {transformers.__version__}")
    out = run_workers(zoo_worker, WORLD, name)[0]
    reference = out["reference"]
    for step, (ours, ref) in enumerate(zip(out["losses"], reference["losses"])):
        assert abs(ours - ref) <= LOSS_RTOL * abs(ref), f"{name} step {step}: loss {ours} vs {ref}"
    assert out["grads"].keys() == reference["grads"].keys()
    largest = max(g.abs().max().item() for g in reference["grads"].values())
    worst = max(((out["grads"][n] - g).abs().max().item(), n) for n, g in reference["grads"].items())
    assert worst[0] <= GRAD_RTOL * largest, f"{name}: first-step gradient of {worst[1]} off by {worst[0] / largest:.2e}"
    if not regions_supported():
        return
    expected_inline = ZOO[name].inline
    if expected_inline is None:
        assert out["region_calls"] > 0, f"{name}: its blocks did not compile as regions"
        assert out["inlined"] == {} and out["warnings"] == []
    else:
        assert list(out["inlined"]) == [expected_inline], out["inlined"]
        (warning,) = out["warnings"]
        assert f"the {expected_inline} blocks" in warning and "compile inline" in warning, warning
    for buffer_name, value in out["buffers"].items():
        assert value.item() == STEPS, f"{name}: {buffer_name} counted {value.item()} calls in {STEPS} steps"
