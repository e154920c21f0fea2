"""TrainConfig: optimisation, logging and checkpointing of `modcli train`, the choices of its flags, and the MoE
training recipe its defaults follow."""

from __future__ import annotations

from dataclasses import dataclass, field

from modcli.config.drops import parse_block_list
from modcli.config.validation import require

DEVICES = ("auto", "cpu", "cuda", "mps")
TRAINABLE = ("all", "routers", "routers+norms", "lora", "blocks:A-B")
OBJECTIVES = ("lm", "block-match", "distill")
LORA_TARGETS = ("qkv", "proj", "gate_up", "down")
"""--lora-targets: the linear layers of a block an adapter may go on (modcli.training.lora)."""
DTYPES = ("float32", "bfloat16", "float16")

EXPERT_RECIPE = {"expert_gate_lr_scale": 0.1, "expert_capacity_warmup": 100}
"""The MoE training defaults of a learned gate (docs/families.md): on `modcli train --preset tiny --dense --experts 4
--max-steps 60` Switch's settings (the gate at --lr, no warm-up) dropped 14-49% of the expert choices at every step
from step 10 on; this recipe drops none in the warm-up and at most 8% at a step after it (160 steps). A run saved
before the fields existed loads with the old values (modcli.config.run.LEGACY_DEFAULTS); later runs' config.json holds them."""


@dataclass
class TrainConfig:
    """Optimisation, logging and checkpointing of `modcli train`."""

    batch_size: int = 16
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimiser step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr x min_lr_ratio."""
    warmup: int = 20
    """Linear warm-up steps."""
    max_steps: int = 300
    """Optimiser steps (also the length of the cosine schedule); 0 with --init-from writes the converted model
    untrained."""
    flops_budget: float = 0.0
    """Stop once this many training FLOPs (forward + backward, `modcli.models.flops.training_flops`) are spent; 0 = no budget."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms, biases or embeddings)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    router_aux_weight: float = 0.1
    """Weight of the router's auxiliary loss: for topk the BCE that teaches the router's sign to match top-k (causal
    decoding), for threshold the capacity regulariser."""
    expert_aux_weight: float = 0.01
    """Weight of the MoE load-balancing loss (Switch Transformer) of each MoE block, the losses summed (Switch's
    0.01 per layer); with --experts."""
    expert_capacity_warmup: int | None = None
    """MoE: the first this many steps train with no expert capacity limit (no choice dropped while the gate learns
    to balance; each expert does the whole batch's slots, and the FLOP count says so); 0 = off. None = 100 with a
    learned gate (EXPERT_RECIPE: with --expert-gate-lr-scale 0.1, no step from step 10 on drops over 10%), 0 with
    hash routing (a fixed table learns nothing) or without experts; runs saved before this default load with 0."""
    expert_aux_sum: bool = field(default=True, metadata={"flag": "--expert-aux-sum/--expert-aux-mean"})
    """Sum the MoE blocks' load-balancing losses (Switch); False (--expert-aux-mean) averages them over the blocks, as
    runs saved before this option did (their config.json loads with False)."""
    router_lr_scale: float = 1.0
    """Learning rate of the router parameters (and predictor) relative to --lr."""
    expert_gate_lr_scale: float = 0.1
    """Learning rate of the MoE gates relative to --lr (a token's first choice flips with a small change of its gate,
    and a lower rate moves fewer tokens between experts: docs/families.md); runs saved before this option load with
    their --router-lr-scale, which the gates followed then."""
    capacity_warmup: int = 0
    """Steps over which the capacity anneals linearly from 1.0 to --capacity (k is fixed within a step); 0 = off."""
    eval_every: int = 100
    """Evaluate and save a checkpoint every this many steps."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    log_every: int = 10
    """Print a progress line every this many steps when stderr is not a terminal."""
    seed: int = 1337
    """Seed for weights, data order and dropout."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""
    dtype: str = "float32"
    """Autocast dtype: float32, bfloat16 or float16."""
    compile: bool = False
    """torch.compile the model."""
    out: str = "runs/latest"
    """Run folder: checkpoints, metrics.jsonl, TensorBoard events."""
    resume: bool = False
    """Continue from the newest complete checkpoint in --out."""
    init_from: str | None = None
    """Start from this run's (or checkpoint's) weights and tokenizer: converts a dense (e.g. imported) model to MoD
    with the routing flags given; routers are new. The shape flags must match it."""
    trainable: str = "all"
    """Which parameters train: all; routers (routers and predictors only; the rest frozen); routers+norms; lora
    (low-rank adapters on the blocks' linear layers, --lora-rank/--lora-alpha/--lora-targets, and the routers; the
    adapters are merged into every saved checkpoint); blocks:A-B (those blocks, e.g. blocks:20-29 or blocks:1,25-29,
    the final norm, the LM head (the embedding too when they are tied) and the routers)."""
    lora_rank: int = 8
    """--trainable lora: the adapters' rank r (each adapted weight W becomes W + (alpha / r) B A)."""
    lora_alpha: float = 16.0
    """--trainable lora: the adapters' scale numerator alpha."""
    lora_targets: str = "qkv,proj,gate_up,down"
    """--trainable lora: the linear layers of every block that get an adapter: qkv (the fused query/key/value
    projection), proj (attention output), gate_up, down (the MLP)."""
    calibrate: bool = False
    """Before the first step, shift each router's (and predictor's) decision boundary so that on the first training
    batch every routed block's causal rule keeps about --capacity of the tokens (a new router's logits sit near 0, so
    "logit > 0" keeps about half whatever --capacity says); the default with --init-from."""
    objective: str = "lm"
    """The training loss: lm (next-token cross-entropy, backward through the whole model) or block-match (each routed
    block's output matched to the dense block's on the dense model's input to it, relative squared error; one forward
    and a backward through the routers only: cheaper per step, for conversions that train the routers). The loss
    reported in training is then the block-match loss; validation stays the language-model loss); or distill (with
    --init-from: the KL divergence from the original model, frozen and run alongside, to this one, at
    --distill-temperature, mixed with the LM loss by --distill-weight; the first --local-steps steps train with the
    block-match loss against the original's blocks instead: blockwise local, then global distillation). With
    block-match or distill and --init-from, each modified block (routed, or with a dropped sublayer) matches the
    original's block on the original's input to it, so a --trainable that trains block weights trains them."""
    distill_temperature: float = 1.0
    """--objective distill: both models' logits are divided by it before the softmax (the KL is scaled by its
    square, Hinton et al.)."""
    distill_weight: float = 1.0
    """--objective distill: the training loss is this x KL + (1 - this) x the LM loss."""
    local_steps: int = 0
    """--objective distill: train the first this many steps (after --router-warmup) with the block-match loss against
    the original's blocks (local distillation: each backward stays inside one block), then with the KL."""
    router_warmup: int = 0
    """Train the first this many steps the routers (and predictors) alone, each against oracle labels at the capacity
    in force: the tokens whose own update in the original block (--init-from's with --objective distill or
    block-match, else the same weights with routing off) is largest, by BCE; then the objective (after it, a
    distill run's --local-steps). 0 = off."""
    keep: int = 3
    """Keep the newest N checkpoints."""
    parallel: str = "ddp"
    """Under torchrun: ddp (replicated) or fsdp (FSDP2 fully_shard per block)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "eval_every", "eval_batches", "log_every", "keep"):
            value = getattr(self, name)
            require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
        require(self.max_steps >= 1 or (self.max_steps == 0 and self.init_from is not None),
                f"--max-steps must be >= 1 (0 only with --init-from: the converted model, untrained), got "
                f"{self.max_steps}")
        require(self.lr > 0, f"--lr must be positive, got {self.lr}")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")
        require(self.flops_budget >= 0, f"--flops-budget must be >= 0, got {self.flops_budget}")
        require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        require(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        require(self.router_aux_weight >= 0, f"--router-aux-weight must be >= 0, got {self.router_aux_weight}")
        require(self.expert_aux_weight >= 0, f"--expert-aux-weight must be >= 0, got {self.expert_aux_weight}")
        require(self.expert_capacity_warmup is None or self.expert_capacity_warmup >= 0,
                f"--expert-capacity-warmup must be >= 0, got {self.expert_capacity_warmup}")
        require(self.router_lr_scale > 0, f"--router-lr-scale must be positive, got {self.router_lr_scale}")
        require(self.expert_gate_lr_scale > 0,
                f"--expert-gate-lr-scale must be positive, got {self.expert_gate_lr_scale}")
        require(self.capacity_warmup >= 0, f"--capacity-warmup must be >= 0, got {self.capacity_warmup}")
        require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        require(self.parallel in ("ddp", "fsdp"), f"--parallel must be ddp or fsdp, got {self.parallel!r}")
        require(self.trainable in TRAINABLE[:-1] or self.trainable.startswith("blocks:"),
                f"--trainable must be one of {', '.join(TRAINABLE)}, got {self.trainable!r}")
        if self.trainable.startswith("blocks:"):
            parse_block_list(self.trainable.removeprefix("blocks:"), 1 << 30, "--trainable blocks")
        require(self.lora_rank >= 1, f"--lora-rank must be >= 1, got {self.lora_rank}")
        targets = [name.strip() for name in self.lora_targets.split(",") if name.strip()]
        require(bool(targets) and all(name in LORA_TARGETS for name in targets),
                f"--lora-targets must name some of {','.join(LORA_TARGETS)}, got {self.lora_targets!r}")
        require(self.lora_alpha > 0, f"--lora-alpha must be positive, got {self.lora_alpha}")
        require(self.distill_temperature > 0, f"--distill-temperature must be positive, got {self.distill_temperature}")
        require(0.0 <= self.distill_weight <= 1.0, f"--distill-weight must be in [0, 1], got {self.distill_weight}")
        require(self.local_steps >= 0, f"--local-steps must be >= 0, got {self.local_steps}")
        require(self.router_warmup >= 0, f"--router-warmup must be >= 0, got {self.router_warmup}")
        require(self.objective != "distill" or self.init_from is not None,
                "--objective distill needs --init-from (the original model to distil from)")
        require(self.local_steps == 0 or self.objective == "distill",
                "--local-steps is the local stage of --objective distill")
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.objective in OBJECTIVES,
                f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
