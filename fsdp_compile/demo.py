"""Train a small character-level GPT with fsdp_compile; run under torchrun.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m fsdp_compile.demo --strategy FULL_SHARD --steps 40

The text is generated (sentences of small-number arithmetic, so there is structure to learn and
no download). Each rank trains on its own batches; rank 0 prints the loss averaged over ranks
and the throughput of every step.

``--grad-accum N`` runs N micro-batches per optimizer step, all but the last under
``backend.no_sync()`` (no gradient reduction in their backward). ``--save DIR`` writes a sharded
checkpoint (model, optimizer, step and every rank's data position) after the last step and
every ``--save-every`` steps; ``--resume DIR`` continues from one, up to ``--steps`` in total,
with the same batches an uninterrupted run would have drawn (at the same world size).

``--checkpoint-dir DIR`` makes a run restartable: it saves ``DIR/step-NNNNNN`` every
``--checkpoint-every`` steps (keeping the last two) and, on start, resumes from the newest
complete checkpoint there. Under ``torchrun --max-restarts 1`` a job whose rank was killed is
restarted by torchrun and continues from there by itself, with the losses of an uninterrupted run:

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 --max-restarts 1 -m fsdp_compile.demo --checkpoint-dir ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.sharding.groups import end_process_group

_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def generate_text(sentences: int = 4000, seed: int = 0) -> str:
    """Sentences like 'three plus four is seven.' with numbers up to twelve."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        a, b = rng.randrange(0, 7), rng.randrange(0, 7)
        if rng.random() < 0.5:
            lines.append(f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}.")
        else:
            hi, lo = max(a, b), min(a, b)
            lines.append(f"{_NUMBERS[hi]} minus {_NUMBERS[lo]} is {_NUMBERS[hi - lo]}.")
    return " ".join(lines)


class CharData:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, size: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - seq - 1, (size,), generator=gen)
        chunks = torch.stack([self.tokens[s:s + seq + 1] for s in starts.tolist()])
        return chunks[:, :-1], chunks[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="FULL_SHARD",
                   help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="inner compiler of the backend")
    p.add_argument("--no-compile", action="store_true", help="run the eager runtime without torch.compile")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    for flag, default in (("--seq-len", 64), ("--layers", 2), ("--d-model", 64), ("--heads", 4), ("--seed", 0)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--shard-size", type=int, default=None, help="hybrid: ranks per shard group")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="micro-batches per optimizer step (all but the last without gradient sync)")
    p.add_argument("--save", metavar="DIR", help="save a sharded checkpoint here after the last step")
    p.add_argument("--save-every", type=int, default=0, metavar="K", help="with --save: also every K steps")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint written with --save")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save DIR/step-NNNNNN every --checkpoint-every steps and resume from the newest one "
                        "there on start (for torchrun --max-restarts)")
    p.add_argument("--checkpoint-every", type=int, default=5, metavar="K", help="with --checkpoint-dir (default 5)")
    args = p.parse_args(argv)
    for wrong, message in ((args.steps < 1, "--steps must be at least 1"),
                           (args.grad_accum < 1, "--grad-accum must be at least 1"),
                           (args.save_every < 0, "--save-every must be >= 0"),
                           (args.save_every and not args.save, "--save-every needs --save DIR"),
                           (args.checkpoint_every < 1, "--checkpoint-every must be at least 1"),
                           (args.checkpoint_dir and args.resume, "--checkpoint-dir resumes by itself; drop --resume")):
        if wrong:
            p.error(message)
    return args


_STEP_DIR = re.compile(r"^\.?step-(\d+)(\.previous)?$")
_KEEP = 2  # checkpoints kept in --checkpoint-dir


def newest_checkpoint(directory: str) -> Path | None:
    """The newest complete checkpoint in ``directory``: ``step-N`` with the largest N, or the
    previous version a save left behind when it died between its two renames."""
    found: dict[int, Path] = {}
    root = Path(directory)
    for entry in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(entry.name)
        if match and (entry.name.startswith("step-") or match.group(2)) and (entry / ".metadata").is_file():
            step = int(match.group(1))
            if step not in found or entry.name.startswith("step-"):
                found[step] = entry
    return found[max(found)] if found else None


def _prune(directory: str) -> None:
    steps = sorted((int(m.group(1)), e) for e in Path(directory).iterdir()
                   if (m := _STEP_DIR.match(e.name)) and e.name.startswith("step-"))
    for _, entry in steps[:-_KEEP]:
        shutil.rmtree(entry, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run the demo under torchrun, e.g.: torchrun --nproc_per_node 2 -m fsdp_compile.demo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_process_group(datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        train(args, rank, world)
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may never reach it
        raise
    end_process_group(exit_process=True)


def init_process_group(timeout: datetime.timedelta) -> None:
    """The gloo group, in a store namespace of its own for each torchrun restart.

    torchrun keeps one rendezvous store across restarts, and gloo reads its peers' addresses
    from it: a restarted rank that starts before the others finds the dead attempt's
    addresses and fails to connect. Keys under the attempt's own prefix cannot be stale.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group("gloo", timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"fsdp_compile.demo/attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    data = CharData(generate_text(seed=args.seed))
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=args.seq_len, n_layer=args.layers,
                    n_head=args.heads, d_model=args.d_model)
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    model = GPT(cfg)
    options = {"shard_size": args.shard_size} if args.shard_size else {}
    backend = fsdp_compile.backend(args.strategy, compiler=args.compiler, **options)
    backend.shard(model)
    forward = model if args.no_compile else torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank its own data
    first_step, resume = 1, args.resume
    if args.checkpoint_dir:
        newest = newest_checkpoint(args.checkpoint_dir)
        resume = str(newest) if newest is not None else None
        if rank == 0 and newest is None:
            print(f"no checkpoint in {args.checkpoint_dir} yet: starting from step 1", flush=True)
    if resume:
        extra = fsdp_compile.load_checkpoint(resume, model, opt)
        first_step = int(extra["step"]) + 1
        positions = extra.get("data_positions", [])
        if len(positions) == world:
            gen.set_state(positions[rank])
        elif rank == 0:
            print(f"checkpoint was written by {len(positions)} ranks, not {world}: data order restarts", flush=True)
        if rank == 0:
            print(f"resumed from {resume} after step {first_step - 1}", flush=True)
    tokens_per_step = args.batch_size * args.seq_len * world * args.grad_accum
    mode = "eager runtime" if args.no_compile else f"torch.compile ({args.compiler})"
    if rank == 0:
        accum = f", {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
        print(f"fsdp_compile demo: {backend.strategy.name}, {world} ranks, {mode}, "
              f"{model.num_parameters():,} parameters, vocabulary {cfg.vocab_size}{accum}", flush=True)
    losses, times = [], []
    for step in range(first_step, args.steps + 1):
        start = time.perf_counter()
        step_loss = torch.zeros(())
        for micro in range(args.grad_accum):
            x, y = data.batch(args.batch_size, args.seq_len, gen)
            last = micro == args.grad_accum - 1
            with contextlib.nullcontext() if last else backend.no_sync():
                logits = forward(x)
                loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1)) / args.grad_accum
                loss.backward()
            step_loss += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        elapsed = time.perf_counter() - start
        losses.append(step_loss.item())
        times.append(elapsed)
        if rank == 0:
            note = "  (includes compilation)" if step == first_step and not args.no_compile else ""
            print(f"step {step:4d} | loss {losses[-1]:.4f} | {tokens_per_step / elapsed:9.0f} tokens/s{note}",
                  flush=True)
        targets = []
        if args.save and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            targets.append(args.save)
        if args.checkpoint_dir and (step == args.steps or step % args.checkpoint_every == 0):
            targets.append(os.path.join(args.checkpoint_dir, f"step-{step:06d}"))
        for target in targets:
            positions: list = [None] * world
            dist.all_gather_object(positions, gen.get_state())  # every rank's data position, for rank 0 to save
            fsdp_compile.save_checkpoint(target, model, opt, extra={"step": step, "data_positions": positions})
            if rank == 0:
                print(f"saved checkpoint {target} at step {step}", flush=True)
        if args.checkpoint_dir and targets and rank == 0:
            _prune(args.checkpoint_dir)
    if rank == 0 and losses:
        steady = times[1:] or times
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              f"{tokens_per_step * len(steady) / sum(steady):.0f} tokens/s after the first step", flush=True)
    elif rank == 0:
        print(f"nothing to do: the checkpoint is at step {first_step - 1} and --steps is {args.steps}", flush=True)


if __name__ == "__main__":
    main()
