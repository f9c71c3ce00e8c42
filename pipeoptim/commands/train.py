"""``pipeoptim train``: run a plan for real and report loss, test accuracy and throughput.

With no arguments it runs the product's main job on its embedded default: PipeOptim on 4
stages, the digits MLP, the local transport (every stage in this process), so a first user
sees the method train to > 90 % test accuracy in seconds on any CPU. Flags override a
``--plan`` file, which overrides the defaults.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeoptim.commands.common import add_json_flag, check_output_paths, print_json
from pipeoptim.errors import RuntimeConfigError
from pipeoptim.plan.methods import METHODS, get_method
from pipeoptim.plan.optimizer_families import ANY_TORCH_OPTIMIZER, FAMILIES, find_family
from pipeoptim.plan.plan import OptimizerSpec, Plan
from pipeoptim.plan.recompute import check_shard_optimizer
from pipeoptim.plan.risk import depth_advice
from pipeoptim.runtime.checkpoint.formats import FORMATS
from pipeoptim.runtime.comm.process_model import ProcessModel
from pipeoptim.runtime.config import AMP_MODES, LR_SCHEDULES, check_offset
from pipeoptim.runtime.optim.global_clip import CLIP_SCOPES
from pipeoptim.runtime.options.tree import option_default

GPT_DEFAULTS = {"lr": 5e-4}
"""What the gpt workload was tuned with (``workloads/gpt.py``); kept here so the command
line does not import torch before it parses."""

if TYPE_CHECKING:
    from pipeoptim.runtime.config import TrainConfig

MODEL_OPTIMIZER = {
    "gpt": ("adamw", GPT_DEFAULTS["lr"]),
    "gpt-deep": ("adamw", GPT_DEFAULTS["lr"]),
    "gpt-deeper": ("adamw", GPT_DEFAULTS["lr"]),
}
"""Built-in models whose default optimizer (and its lr) is not SGD with momentum."""

_EPILOG = """\
examples:
  pipeoptim train                                    # PipeOptim, 4 stages, digits MLP, local
  pipeoptim train --method pipedream --optimizer adam --lr 1e-3 --epochs 5
  pipeoptim train --method 2bw --micro-batches 4 --model cnn --trace run.json
  pipeoptim train --transport dist --stages 4        # one process per stage (gloo/NCCL)
  torchrun --nproc-per-node 4 -m pipeoptim.cli train --transport dist --stages 4
  pipeoptim train --transport dist --stages 2 --data-parallel 2   # 2 replicas x 2 stages
  pipeoptim train --checkpoint-dir ckpt --checkpoint-every 20 [--resume]
  pipeoptim train --model examples/custom_model.py:make_model

checkpoints: an asynchronous pipeline never flushes, so the whole run is one continuous
pipeline across epochs; it drains only every --checkpoint-every K mini-batches (and at the
end), where checkpoints are written with nothing in flight. --resume continues from the
latest one and gives the same weights as an uninterrupted run with the same settings.
Without a checkpoint, --resume starts fresh.

language model: --model gpt trains a small decoder-only transformer on a character corpus
built offline from the Python standard library's own source files (AdamW, lr {gpt_lr} unless
given; test loss and perplexity reported).

user models: --model module:factory or path/to/file.py:factory, where factory() returns an
nn.Sequential or a list of layers. It trains on digits (64 float features, 10 classes)
unless the module also defines dataset() returning (train_x, train_y, test_x, test_y).
"""


def _default_lr_text() -> str:
    """The default rates as the help states them, from each family's ``default_lr`` and the
    models' own: the rate most families share is the "else"."""
    rates = [f.default_lr for f in FAMILIES.values()]
    usual = max(rates, key=rates.count)
    own = [f for f in FAMILIES.values() if f.default_lr != usual]
    others = sorted({v for v in rates if v not in {f.default_lr for f in own}})
    by_model: dict[tuple[str, float], list[str]] = {}
    for model, (family, lr) in MODEL_OPTIMIZER.items():
        by_model.setdefault((family, lr), []).append(model)
    models = "; ".join(
        f"{lr:g} for {family} on {', '.join(names)} (their default optimizer)"
        for (family, lr), names in by_model.items()
    )
    return (
        f"{', '.join(f'{f.default_lr:g} for {f.name}' for f in own)}, "
        f"else {' or '.join(f'{v:g}' for v in others)}; {models}"
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model with a pipeline method (default: PipeOptim, 4 stages, digits MLP)",
        description="Train with a pipeline-parallel method and print final loss, test "
        "accuracy and samples/s. Without arguments: PipeOptim, 4 stages, the digits MLP, "
        "local transport.",
        epilog=_EPILOG.replace("{gpt_lr}", f"{GPT_DEFAULTS['lr']:g}"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--plan",
        metavar="FILE",
        help="Plan JSON (method, stages, boundaries, optimizer...); explicit flags override it",
    )
    p.add_argument("--method", help=f"one of {', '.join(METHODS)} (default pipeoptim)")
    p.add_argument("--stages", type=int, metavar="P", help="pipeline stages (default 4)")
    p.add_argument(
        "--model",
        help="mlp, cnn, transformer, gpt, gpt-deep, gpt-deeper, or module:factory (default mlp)",
    )
    p.add_argument(
        "--optimizer",
        help="sgd (momentum 0.9), adam, adamw, rmsprop, nadam, muon (Muon on the weight "
        "matrices, AdamW on the rest), or basis-rotation (Adam in each weight matrix's "
        "gradient eigenbasis, Adam on the rest) (default sgd)",
    )
    p.add_argument(
        "--lr",
        type=float,
        help=f"learning rate (default {_default_lr_text()})",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        metavar="M",
        help="micro-batches per mini-batch, micro-batching methods only (default: 1 for "
        "pipeoptim, whose stage k then runs P-1-k updates behind and ⌈(P-1-k)/M⌉ with M; "
        "else P, or the next count that divides the batch size)",
    )
    p.add_argument(
        "--batch-size", type=int, metavar="B", help="samples per mini-batch (default 32)"
    )
    p.add_argument("--epochs", type=int, metavar="E", help="epochs (default 10 unless --max-steps)")
    p.add_argument("--max-steps", type=int, metavar="K", help="stop after K mini-batches in all")
    p.add_argument(
        "--transport",
        choices=[m.value for m in ProcessModel],
        default=None,
        help="local: all stages in this process; dist: one process per stage (default: "
        "local, or dist when the plan or --data-parallel asks for D > 1 replicas)",
    )
    p.add_argument(
        "--data-parallel",
        type=int,
        metavar="D",
        help="D replicas of the pipeline (dist only: D x P processes), each training on 1/D of "
        "every batch and averaging gradients before each update (default: the plan's, or 1)",
    )
    p.add_argument(
        "--shard-optimizer",
        action="store_true",
        default=None,
        help="shard each stage's optimizer state across its D replicas (ZeRO-1): each keeps "
        "and updates 1/D of it, then the weights are gathered; needs --data-parallel 2 or "
        "more (default: the plan's, else off)",
    )
    p.add_argument(
        "--device",
        default=option_default("device"),
        help="auto (cuda if present), cpu, cuda, cuda:N",
    )
    p.add_argument("--checkpoint-dir", metavar="D", help="write per-stage checkpoints here")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="K",
        help="also cut a segment and checkpoint every K mini-batches (default: per epoch)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in D")
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        metavar="K",
        help="keep the K newest checkpoints; a resume falls back to an older one when the "
        f"newest is damaged (default {option_default('keep_checkpoints')})",
    )
    p.add_argument(
        "--checkpoint-format",
        choices=sorted(FORMATS),
        default=option_default("checkpoint_format"),
        help="how each stage is written: torch-save (one file) or dcp (a "
        "torch.distributed.checkpoint folder under model-level names); --resume reads either, "
        "and may change --stages or the plan's partition (the state is re-cut by unit) "
        f"(default {option_default('checkpoint_format')})",
    )
    p.add_argument("--trace", metavar="FILE", help="write the run's trace (pipeoptim trace JSON)")
    seed = option_default("seed")
    p.add_argument(
        "--seed", type=int, default=seed, help=f"weights and data order (default {seed})"
    )
    p.add_argument(
        "--prediction-offset",
        type=int,
        metavar="N",
        help="add N to the derived prediction distance s (1 = reference code's D-rank)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=option_default("timeout"),
        help=f"seconds a rank waits for another before failing (default "
        f"{option_default('timeout'):g})",
    )
    p.add_argument(
        "--lr-schedule",
        default="constant",
        choices=LR_SCHEDULES,
        help="learning-rate schedule, stepped once per update on every stage (default constant)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        metavar="K",
        help="warm-up updates of warmup-cosine (default 5%% of the run)",
    )
    p.add_argument(
        "--amp",
        choices=AMP_MODES,
        help="mixed precision: bf16 (CPU and CUDA) or fp16 (CUDA, loss scaling per stage)",
    )
    p.add_argument(
        "--grad-clip",
        type=float,
        metavar="NORM",
        help="clip the gradient norm to NORM before each update (whose norm: --clip-scope)",
    )
    p.add_argument(
        "--clip-scope",
        choices=CLIP_SCOPES,
        help="the norm --grad-clip bounds: pipeline (every stage's gradients of one "
        "mini-batch: the whole model's, as clip_grad_norm_ on one device, for synchronous "
        "methods) or stage (each stage its own); default: pipeline for synchronous "
        "methods, stage for asynchronous ones",
    )
    p.add_argument(
        "--extrapolation",
        type=float,
        metavar="LAMBDA",
        help="λ of the extrapolate correction (xpipe+extrapolate, 2bw+extrapolate, "
        "pipeoptim+extrapolate): each update is x - lr*[(1+λ)u_t - λu_(t-1)], u the "
        "optimizer's own update; 0 is the plain step (default 0.5)",
    )
    p.add_argument(
        "--recompute",
        metavar="WHAT",
        help="recompute activations in the backward instead of keeping them: none, full (every "
        "unit of every stage), stages:0,1 (those stages in full) or units:NAME,NAME (units by "
        "index, name or class); default: the plan's, else none",
    )
    p.add_argument(
        "--log",
        action="append",
        default=[],
        metavar="SCHEME:TARGET",
        help="log the run (repeatable): tensorboard:DIR (the [tensorboard] extra), "
        "wandb:PROJECT (the [wandb] extra; offline unless WANDB_MODE=online) or jsonl:FILE; "
        "at each log point: loss, learning rate, samples/s, evaluation, and per "
        "stage memory, waits, prediction distance and weight copies",
    )
    p.add_argument(
        "--forwards-first",
        action="store_true",
        help="local transport: each stage runs its forwards between two updates back to back, "
        "then its backwards (the same weights bit for bit; faster on one thread at many "
        "stages, at up to one more mini-batch of activations per stage)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        metavar="MODE|BACKEND",
        help="torch.compile each unit once at stage build: inductor by default, or an "
        "inductor mode (max-autotune-no-cudagraphs...) or a backend's name (aot_eager...)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_json_flag(p)
    p.set_defaults(func=handler)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of the command line: flags over --plan over the defaults."""
    from pipeoptim.runtime.config import TrainConfig

    for flag, value in (
        ("stages", args.stages),
        ("batch-size", args.batch_size),
        ("micro-batches", args.micro_batches),
        ("keep-checkpoints", args.keep_checkpoints),
        ("data-parallel", args.data_parallel),
    ):
        if value is not None and value < 1:
            raise RuntimeConfigError(f"--{flag} must be at least 1 (got {value})")
    if args.prediction_offset is not None and args.prediction_offset < 0:
        raise RuntimeConfigError(
            f"--prediction-offset must be 0 or more (got {args.prediction_offset}): it adds "
            f"updates to the derived distance s; 0 is the paper's rule, 1 the reference code's"
        )
    base = Plan.load(args.plan) if args.plan else None
    method = args.method or (base.method if base else "pipeoptim")
    spec = get_method(method)
    stages = args.stages if args.stages is not None else (base.num_stages if base else 4)
    if args.prediction_offset is not None:
        check_offset(args.prediction_offset, method, stages, given=True, flag="--prediction-offset")
    model = args.model or (base.model if base and base.model else "mlp")
    same_layout = base is not None and stages == base.num_stages and model == (base.model or model)
    if base is not None and base.boundaries and not same_layout:
        print(
            f"pipeoptim train: note: the plan's partition was made for {base.num_stages} stages "
            f"of model {base.model}; running {stages} stages of {model} with an even split",
            file=sys.stderr,
        )
    batch = args.batch_size or (base.batch_size if base else None) or 32
    if args.micro_batches is not None:
        micro = args.micro_batches
    elif base is not None and base.method == method:  # the plan's, made for this method
        micro = base.micro_batches
    elif spec.dials_micro_batches:  # the method's own default (pipeoptim: whole mini-batches)
        micro = spec.default_micro_batches_at(stages)
    else:  # P micro-batches, or the next count that divides the batch
        micro = next((m for m in range(stages, batch + 1) if batch % m == 0), stages)
        micro = spec.micro_batches_for(micro)
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise RuntimeConfigError(
            f"--lr must be a positive finite number (got {args.lr}); e.g. --lr 0.05, or leave "
            f"it out for the optimizer's default"
        )
    model_family, model_lr = MODEL_OPTIMIZER.get(model, ("sgd", None))
    family = args.optimizer or (base.optimizer.family if base else model_family)
    same_family = base is not None and base.optimizer.family == family
    lr = args.lr if args.lr is not None else (base.optimizer.lr if base and same_family else None)
    optimizer = OptimizerSpec(
        family,
        lr
        if lr is not None
        else model_lr
        if model_lr is not None and family == model_family
        else (find_family(family) or ANY_TORCH_OPTIMIZER).default_lr,
        dict(base.optimizer.options) if base and same_family else {},
    )
    offset = args.prediction_offset
    same_method = base is not None and base.method == method
    virtual = base.virtual_stages if base and same_method else spec.default_virtual_stages
    replicas = args.data_parallel or (base.data_parallel if base else 1)
    shard = args.shard_optimizer or (base.shard_optimizer if base else False)
    check_shard_optimizer(shard, replicas, flag="--shard-optimizer", error=RuntimeConfigError)
    plan = Plan(
        method,
        stages,
        micro_batches=micro,
        virtual_stages=virtual,
        prediction_offset=offset if offset is not None else (base.prediction_offset if base else 0),
        optimizer=optimizer,
        model=model,
        batch_size=batch,
        boundaries=base.boundaries if same_layout and base else None,
        devices=base.devices if base else None,
        data_parallel=replicas,
        shard_optimizer=shard,
        # per stage: the plan's where its layout is kept (--recompute overrides it)
        recompute=base.recompute
        if same_layout and base and virtual == base.virtual_stages
        else None,
    )
    # D > 1 replicas are D x P processes: a plan (or --data-parallel) asking for them starts
    # them, as `pipeoptim plan --devices` promises; an explicit --transport local is refused
    many = ProcessModel.PROCESS_PER_STAGE if plan.data_parallel > 1 else ProcessModel.ONE_PROCESS
    transport = args.transport or many.value
    return TrainConfig(
        plan,
        epochs=args.epochs,
        max_steps=args.max_steps,
        transport=transport,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        trace=args.trace,
        seed=args.seed,
        device=args.device,
        quiet=args.quiet or args.json,
        recompute=args.recompute,
        log=tuple(args.log),
        timeout=args.timeout,
        lr_schedule=args.lr_schedule,
        warmup=args.warmup,
        amp=args.amp,
        grad_clip=args.grad_clip,
        clip_scope=args.clip_scope,
        extrapolation=args.extrapolation,
        keep_checkpoints=args.keep_checkpoints or option_default("keep_checkpoints"),
        checkpoint_format=args.checkpoint_format,
        forwards_first=args.forwards_first,
        compile=args.compile,
    )


def _check_checkpoint_dir(path: str) -> None:
    """Before any work: a folder that is, or can become, a writable checkpoint folder."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise RuntimeConfigError(
            f"--checkpoint-dir {path!r} is a file, not a folder; give a folder (it is created "
            f"if missing)"
        )
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise RuntimeConfigError(
            f"--checkpoint-dir {path!r}: cannot create or write it under {str(existing)!r}; "
            f"give a folder you can write"
        )


def handler(args: argparse.Namespace) -> int:
    from pipeoptim.errors import NonFiniteLossError
    from pipeoptim.workloads.train import train

    check_output_paths(args, ["--trace"])
    if args.checkpoint_dir:
        _check_checkpoint_dir(args.checkpoint_dir)
    config = build_config(args)
    plan = config.plan
    advice = depth_advice(plan.method, plan.num_stages, plan.optimizer.family, plan.micro_batches)
    if advice is not None and not args.json:  # before the hours, not after them
        print(f"pipeoptim train: note: {advice}", file=sys.stderr)
    try:
        result = train(config)
    except NonFiniteLossError as err:
        if args.json and err.partial is not None:  # what ran, with the error
            print_json({**err.partial.summary(), "error": str(err)})
        raise
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    status = 2 if result.unwritten else 0
    if args.json:
        summary = result.summary()
        summary["trace_file"] = args.trace if not result.unwritten else None
        print_json(summary)
        return status
    plan = config.plan
    m = result.micro_batches
    ranks = f" on {plan.num_stages} ranks" if plan.num_stages != result.num_stages else ""
    if plan.data_parallel > 1:
        ranks += f" x {plan.data_parallel} data-parallel replicas"
    print(
        f"pipeoptim train: {result.method}, {result.num_stages} stages{ranks}, "
        f"model {result.model}, {plan.optimizer.family} lr {plan.optimizer.lr:g}, "
        f"batch {result.batch_size} "
        f"({m} micro-batch{'es' if m > 1 else ''}), {result.transport} transport on {result.device}"
    )
    steps = result.end_step - result.start_step
    train_acc = (
        f", train accuracy {result.train_accuracy:.1%}" if result.train_accuracy is not None else ""
    )
    print(
        f"steps {result.start_step}..{result.end_step} ({steps} mini-batches) in "
        f"{result.train_seconds:.1f} s: final loss {result.final_loss:.4f}{train_acc}, "
        f"{result.samples_per_second:.0f} samples/s"
    )
    if result.eval is not None:
        ev = result.eval
        acc = f"test accuracy {ev.accuracy:.1%}, " if ev.accuracy is not None else ""
        ppl = f", perplexity {ev.perplexity:.2f}" if config.model in MODEL_OPTIMIZER else ""
        print(f"{acc}test loss {ev.loss:.4f}{ppl} ({ev.samples} samples)")
    for note in result.notes:
        if note != advice:  # said before training
            print(f"note: {note}")
    copies = " ".join(str(result.weight_copies[k]) for k in sorted(result.weight_copies))
    print(f"weight copies per stage (peak): {copies}")
    if args.trace and not result.unwritten:
        print(f"trace: {args.trace}")
    if config.checkpoint_dir:
        print(f"checkpoint: {config.checkpoint_dir} (step {result.end_step})")
    for path in result.unwritten:
        print(f"pipeoptim train: not written: {path} (see the note above)", file=sys.stderr)
    return status
