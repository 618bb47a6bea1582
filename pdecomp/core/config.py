"""The run schema: frozen dataclasses, one per config group, at the bottom of the package
(it imports no other pdecomp module).

The launcher registers these classes in Hydra's ConfigStore (the "config registry"), so a
typo or a wrong type fails at compose time; `pdecomp.plan.validation.validate` then checks what
types cannot, against the registries beside each choice's implementation. Every error names
the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import enum
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any


# The string-valued choices that have no implementation to dispatch to: str Enums, so a bad
# value fails at compose time (OmegaConf names the allowed ones) and equals its string.
# The method's choices live in registries beside their implementations, each name declared
# once (docs/method.md, "Adding a choice").
class FitMode(enum.StrEnum):
    none = "none"
    batch = "batch"  # the largest batch under the cap
    microbatches = "microbatches"  # the fewest microbatches under the cap
    mesh = "mesh"  # the data x model split with the least predicted step time under the cap


class DType(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class DataSource(enum.StrEnum):
    toy = "toy"  # the toy target's sparse features
    synthetic = "synthetic"
    tokens = "tokens"
    hf_dataset = "hf_dataset"


class TokenDType(enum.StrEnum):
    uint16 = "uint16"
    uint32 = "uint32"


FIT_MODES, DTYPES = tuple(FitMode), tuple(DType)
DATA_SOURCES, TOKEN_DTYPES = tuple(DataSource), tuple(TokenDType)
MESH_AXES = ("data", "model", "none")
LOGICAL_AXES = ("batch", "comp", "embed", "ci_embed", "ci_in")
REMAT_NAMES = ("site_inner", "site_out", "layer_out")  # checkpoint_name tags in the forward
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")
LLAMA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ROPE_TYPES = ("default", "llama3")  # the RoPE the Llama target computes
# Llama-3's frequency scaling reads every one of these; each must be a number > 0.
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings")


# Seeds (`seed`, `model.seed`) are integers in [0, SEED_MAX] for every model kind: numpy's
# SeedSequence refuses negative entropy, a JAX key keeps 32 bits (2**32 is 0's key), and
# the seeds derived by offset (evaluation: seed + 10,000; target retraining: model.seed +
# 1,000 per attempt, its held-out language + 1,000,000) must stay distinct 32-bit keys.
SEED_MAX = 2**31 - 1
EVAL_SEED_OFFSET = 10_000  # eval batches come from their own seed, not training's


class ConfigError(ValueError):
    """A bad value in the run config. `str()` is the one-line message shown to the user."""

    def __init__(self, key: str, value: Any, allowed: str):
        if isinstance(value, enum.Enum):  # as it was written
            value = value.value
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config error: {key}={value!r} is not allowed; {allowed}")


@dataclass(frozen=True)
class ModelConfig:
    """The frozen target: what every model kind's config has. Each kind's schema (its
    `Kind.schema`, registered as the schema of its `model/` options) adds its own fields, so
    a key of another kind fails at compose time."""

    name: str = "tms_5-2"
    kind: str = "tms"  # a name in pdecomp.kinds.KINDS
    seed: int = 0
    cache_dir: str = ""  # trained targets' cache; empty: $PDECOMP_CACHE or ~/.cache/pdecomp


@dataclass(frozen=True)
class TrainedModelConfig(ModelConfig):
    """A target trained in-process and cached by its settings (the toys, a pathless Llama)."""

    train_steps: int = 10_000
    train_batch_size: int = 1024
    train_lr: float = 5e-3
    max_retrain: int = 3  # retries with a new seed when the target fails its check


@dataclass(frozen=True)
class TMSConfig(TrainedModelConfig):
    """Toy model of superposition: `n_features` sparse features in `d_hidden` dimensions."""

    n_features: int = 5
    d_hidden: int = 2  # the hidden size m
    n_hidden_layers: int = 0  # +ID variants: fixed identity layers between linear1/linear2
    feature_prob: float = 0.05


@dataclass(frozen=True)
class ResidMLPConfig(TrainedModelConfig):
    """Residual MLP: features embedded in a `d_embed` stream, `n_layers` ReLU MLPs of
    `d_hidden` neurons."""

    name: str = "resid_mlp1"
    kind: str = "resid_mlp"
    n_features: int = 5
    d_hidden: int = 2  # neurons per layer
    d_embed: int = 1000  # residual stream width
    n_layers: int = 1
    feature_prob: float = 0.05


@dataclass(frozen=True)
class LlamaModelConfig(TrainedModelConfig):
    """A Llama, read from the Hugging Face directory `path`, whose config.json then defines
    the architecture. Without a path the fields below give its shapes (enough for the
    gate), and it is trained on the synthetic language for `train_steps` steps and cached
    like a toy, or keeps random weights when that is 0."""

    name: str = "llama"
    kind: str = "llama"
    path: str = ""  # a HF directory (config.json + safetensors)
    # the architecture without a path (HF config.json names in comments)
    vocab_size: int = 128
    d_embed: int = 1000  # hidden_size
    n_layers: int = 1  # num_hidden_layers
    d_mlp: int = 160  # intermediate_size
    n_heads: int = 4  # num_attention_heads
    n_kv_heads: int = 4  # num_key_value_heads
    head_dim: int = 0  # 0: d_embed / n_heads
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # e.g. rope_type: llama3, ...
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attn_bias: list[str] = field(default_factory=list)  # q_proj, k_proj, v_proj: Qwen2's
    sliding_window: int = 0  # Mistral's sliding_window in every layer; 0: full attention
    qk_norm: bool = False  # Qwen3's RMSNorm over each head's query and key before RoPE


@dataclass(frozen=True)
class LayersConfig:
    """Which sites to decompose and with how many components each."""

    sites: list[str] = field(default_factory=lambda: ["linear1", "linear2"])
    C: int = 20
    C_per_site: dict[str, int] = field(default_factory=dict)  # overrides C for named sites
    # > 0: C of each site = this x its matrix's largest dimension (the published recipe's
    # "C about the largest dimension": 1.0), in place of `C`
    C_per_dim: float = 0.0
    delta: bool = True
    ci_fn: str = "mlp"  # a name in pdecomp.spd.ci.CI_FNS
    ci_hidden: list[int] = field(default_factory=lambda: [16])
    # global_transformer: one network over all sites' inputs (docs/method.md)
    ci_d_model: int = 64
    ci_blocks: int = 2
    ci_heads: int = 4
    ci_mlp: int = 256
    # A target with tied weights (TMS: linear2 = linear1ᵀ) gets tied components too: the
    # follower's V, U are its leader's Uᵀ, Vᵀ and own no parameters (as in the SPD paper).
    tie: bool = True
    # How the one set of tied parameters is updated. `per_site`: each site's gradient gets
    # its own AdamW moments and step, and both steps land on the shared parameters (what the
    # public PyTorch implementation does, where the follower's parameters are transposed
    # views); TMS 40-10 needs it for its 40 live components. `shared`: one AdamW step on the
    # summed gradient of both sites.
    tie_update: str = "per_site"  # a name in pdecomp.spd.step.TIE_UPDATES


@dataclass(frozen=True)
class ReconTermConfig:
    """One stochastic reconstruction term: a plan of forwards, a source and a routing."""

    coeff: float = 1.0
    plan: str = "all"  # a name in pdecomp.spd.masks.PLANS
    sites_per_chunk: int = 0  # chunkwise only
    source: str = "continuous"  # a name in pdecomp.spd.masks.SOURCES
    routing: str = "all"  # a name in pdecomp.spd.masks.ROUTINGS


@dataclass(frozen=True)
class PGDConfig:
    """The persistent adversarial recon term: trainable sources that persist across steps,
    ascended to make the all-sites-live forward as unfaithful as possible."""

    coeff: float = 0.0  # 0: off
    scope: str = "per_position"  # a name in pdecomp.spd.masks.PGD_SCOPES
    # a name in pdecomp.spd.adversary.PGD_OPTIMIZERS; adam with b1 0.5, b2 0.99, eps 1e-8
    optimizer: str = "adam"
    lr: float = 0.01
    warmup_frac: float = 0.025  # linear lr warmup, as a fraction of optim.steps
    n_warmup: int = 2  # extra ascents before each step's loss


@dataclass(frozen=True)
class EvalPGDConfig:
    """Fresh (non-persistent) PGD in evaluation (LMs): sources drawn anew for every batch,
    one per component and `scope` (shared: one for the whole batch and every position, as
    the published figures draw them; per_position; per_token), then `n_steps` sign ascents
    of `step_size` on the KL, each followed by a clamp to [0, 1]. 0 steps: off. `curve_to`:
    the final evaluation also gives the KL after n_steps, 2 n_steps, 4 n_steps, ... up to
    `curve_to` ascents of one adversary (`kl/pgd_<n>`; VPD's 20/40/80/160: n_steps 20,
    curve_to 160; none while n_steps is 0)."""

    n_steps: int = 20
    step_size: float = 0.1
    scope: str = "shared"  # a name in pdecomp.spd.masks.PGD_SCOPES
    curve_to: int = 0

    @property
    def marks(self) -> tuple[int, ...]:
        """The ascent counts of the final evaluation's curve (none without `curve_to`)."""
        out, n = [], self.n_steps
        while 0 < n <= self.curve_to:
            out.append(n)
            n *= 2
        return tuple(out)


@dataclass(frozen=True)
class LossConfig:
    faithfulness_coeff: float = 0.0
    imp_min_coeff: float = 3e-3
    p_start: float = 1.0
    p_end: float = 1.0
    p_anneal_start_frac: float = 0.0
    p_anneal_end_frac: float = 1.0
    beta: float = 0.0
    eps: float = 1e-12
    # The per-value penalty of importance minimality (a name in pdecomp.spd.losses.PENALTIES):
    # lp, (c + eps)^p with p annealed p_start -> p_end; smooth_l0, c^2 / (c^2 + gamma^2)
    # with gamma annealed gamma_start -> gamma_end (the same fractions), flat at c = 0.
    imp_min_penalty: str = "lp"
    gamma_start: float = 1.0
    gamma_end: float = 0.01
    ci_threshold: float = 0.1
    distance: str = "mse"  # a name in pdecomp.spd.losses.DISTANCES
    recon: dict[str, ReconTermConfig] = field(
        default_factory=lambda: {
            "full": ReconTermConfig(plan="all"),
            "layerwise": ReconTermConfig(plan="layerwise"),
        }
    )
    pgd: PGDConfig = field(default_factory=PGDConfig)
    eval_pgd: EvalPGDConfig = field(default_factory=EvalPGDConfig)


@dataclass(frozen=True)
class OptGroupConfig:
    """AdamW over one parameter group, with its own schedule and clipping."""

    lr: float = 1e-3
    schedule: str = "cosine"  # a name in pdecomp.spd.step.SCHEDULES
    warmup_frac: float = 0.0
    final_frac: float = 0.0  # lr at the end, as a fraction of lr
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 0.0  # global-norm clip; 0 disables


@dataclass(frozen=True)
class OptimConfig:
    steps: int = 10_000
    components: OptGroupConfig = field(default_factory=OptGroupConfig)
    ci_fn: OptGroupConfig = field(default_factory=OptGroupConfig)
    # Gradient accumulation: the batch's step taken over this many microbatches in turn
    # (the same step: imp-min's whole-batch sums first, then each microbatch's gradient).
    microbatches: int = 1
    # Or the examples each device of the mesh's data axis takes per microbatch (0: the count
    # above): microbatches = batch / (this x data axis), so a preset follows its mesh.
    microbatch_size: int = 0
    faith_warmup_steps: int = 200
    faith_warmup_lr: float = 0.01
    faith_warmup_weight_decay: float = 0.1
    # A resume keeps the run's schedule: a changed optim.steps, lr, schedule, warmup or final
    # fraction, PGD lr or p annealing is refused unless this is true (e.g. to extend a run).
    allow_schedule_change: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Toy targets sample their sparse features; a Llama reads token windows (docs/data.md)."""

    batch_size: int = 4096
    eval_batches: int = 8  # batches of the final metrics (live, L0, MMCS, CE); 0: none
    source: DataSource = DataSource.toy
    path: str = ""  # tokens: a flat token file; hf_dataset: a save_to_disk directory
    token_dtype: TokenDType = TokenDType.uint16  # tokens
    column: str = "input_ids"  # hf_dataset: the column of token ids
    seq_len: int = 512
    # tokens / hf_dataset: the stream's last eval_frac of tokens is held out; training never
    # reads it and the final evaluation reads only it (0: evaluate on the training stream)
    eval_frac: float = 0.01
    # tokens: where the file records its documents' starts (`pdecomp tokenize` does), a
    # window's positions attend only within their document and count RoPE from its start,
    # and the held-out part begins at a document; false: the file as one stream
    documents: bool = True


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: a data axis and a model axis. The batch is split over data, each site's
    components over model (along C); with `shard_state` (FSDP) the optimizer moments and
    the adversary are split over data too, and with `shard_weights` the frozen target,
    components and CI function as well."""

    name: str = "local"
    data: int = 0  # devices on the data axis; 0: every device (local) or hosts x gpus_per_host
    hosts: int = 1  # the GPUs a run is sized for: a deviceless gate compiles for
    gpus_per_host: int = 0  # hosts x gpus_per_host of them (0: one GPU)
    shard_state: bool = False
    # With shard_state: the weights (frozen target, components, CI function) split over data
    # too (ZeRO-3: least memory; every pass over a microbatch gathers them, across hosts on
    # a multi-host data axis), or (false) whole on each data replica, only the moments and
    # the adversary split (ZeRO-1: the gradients reduced across data instead).
    shard_weights: bool = True
    # Devices on the model axis (they hold one C-slice each of every site's components and
    # CI logit head, and of the [*pos, C] activations); the rest of the mesh is the data
    # axis. Keep it within a host: its all-reduces run on every site matmul.
    model: int = 1
    # Logical axis -> mesh axis (`data`, `model`, or `none`: replicated). Logical axes: batch
    # (activations' first position axis), comp (a site's C), embed (site weight dims),
    # ci_embed (the CI logit head's input), ci_in (the global CI transformer's input: every
    # site's input side by side, its w_in's rows). FSDP (`shard_state`) then splits each leaf's
    # largest unnamed dimension on `data`.
    rules: dict[str, str] = field(default_factory=lambda: {"batch": "data", "comp": "model"})
    # Multi-process jobs: how long a rank waits for every process to join jax.distributed
    # before it gives up with an error (instead of hanging until the time limit).
    init_timeout_s: int = 300


@dataclass(frozen=True)
class MemoryConfig:
    hbm_cap_gib: float = 0.0  # 0: the device's own limit times safety_fraction
    safety_fraction: float = 0.9
    donate: bool = True
    compute_dtype: DType = DType.float32
    target_dtype: DType = DType.float32  # storage of the frozen target
    # The operands of the forwards' matmuls (the target's linears, attention and head, the
    # components'), each product summed and returned in compute_dtype: bfloat16 here with
    # compute_dtype float32 is mixed precision (matmuls at the bfloat16 units' rate; norms,
    # softmaxes, masks and the losses in float32). None: compute_dtype.
    matmul_dtype: DType | None = None
    # Rematerialization of each recon forward (a name in pdecomp.core.memory.REMAT): none keeps
    # every activation for the backward; full keeps only the forward's inputs; save_dots keeps matmul
    # outputs; names keeps the tensors tagged `remat_names`; offload moves those to host.
    remat: str = "none"
    remat_names: list[str] = field(default_factory=lambda: ["layer_out"])
    # Stream the CI function's output: each site's logits are recomputed where they are used
    # (imp-min's sums, each recon forward, L0) from features kept once, rather than every
    # site's [*pos, C] logits, lower and upper being kept for the whole step. Costs the
    # logit linear again per use (global_transformer: d_model x C per position and site).
    stream_ci: bool = False
    # KL and CE over chunks of this many sequence positions (0: whole): the clean forward's
    # log-probs (the recon target, and the evaluation's) are kept as its logits in their
    # dtype with a float32 log-normaliser, and each KL, its backward and each CE take the
    # float32 log-probs a chunk at a time: no [*pos, V] float32 tensor is held for the step.
    # Must divide data.seq_len.
    logits_chunk: int = 0
    # Rematerialize layer by layer inside the scanned runs of target layers and the global CI
    # transformer's blocks: a backward through them keeps one layer's activations (LMs: its
    # [B, heads, T, T] attention scores) at a time, at one more forward per layer (runs of
    # site layers keep what `site_layer_saves` names and recompute the rest).
    remat_layers: bool = False
    # What a rematerialized run of site layers keeps per layer (a name in
    # pdecomp.core.memory.SITE_LAYER_SAVES): linears (every batchless matmul), sites (the
    # components' inner activations and the site outputs), nothing (the layer's input).
    site_layer_saves: str = "linears"
    # Keep the optimizer moments of components and CI function in pinned host memory between
    # steps: each step copies them to the device for the update and back. Frees their bytes
    # on the device for the whole forward and backward, at two host transfers per step.
    offload_opt_state: bool = False


@dataclass(frozen=True)
class GateConfig:
    only: bool = False  # report and exit
    # local (this job's devices) or a name in pdecomp.core.hardware.GPUS (a GPU to compile for)
    target: str = "local"
    fit: FitMode = FitMode.none  # batch: find the largest batch under the cap
    fit_max_batch: int = 1 << 20  # upper end of the batch search
    top_temps: int = 8  # largest temporaries listed from XLA's buffer assignment; 0: none
    calibrate_after: int = 10  # steps before the measured peak is read (where reported)


# offline: files in the run directory, `wandb sync` sends them later; disabled: no wandb.
WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class WandbConfig:
    """wandb's own settings for the run, as wandb names them. Empty strings: wandb's default
    (its environment variables and `wandb login` settings, then pdecomp's)."""

    mode: str = ""  # offline | online | disabled; "": $WANDB_MODE, else offline
    project: str = "pdecomp"
    entity: str = ""  # "": $WANDB_ENTITY, else the login's default
    name: str = ""  # "": the preset and what the job sets (a sweep's job: what it varies)
    group: str = ""  # "": a sweep's jobs share the sweep's; a single run has none
    job_type: str = "decompose"
    tags: list[str] = field(default_factory=list)  # the preset's name is added
    # The final checkpoint (by reference: its path, nothing copied) and the analysis
    # report (its files) as artifacts of the run.
    artifacts: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 100
    ckpt_every: int = 2000  # 0: only at the end
    # Evaluation in the loop, on the final evaluation's held-out batches (0: off): every
    # `eval_every` steps the fast tier (live and L0 per site, a kind's own metrics: CE and KL
    # under each mask and the fresh adversary's KL for an LM), as `eval/...` in history.json
    # and wandb; every `slow_eval_every` steps the slow tier, plots of the CI's distribution
    # and of each component's firing density (`eval/<step>/`).
    eval_every: int = 0
    slow_eval_every: int = 0
    # How often the processes of a job agree whether a scheduler asked them to stop (a
    # collective; SLURM warns `signal_delay_s` ahead, which must cover this many steps).
    stop_check_every: int = 10
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True
    plots: bool = True
    # The summary key a job hands a sweeper that chooses the next jobs from the last ones'
    # results (Optuna's, Nevergrad's, Ax's), e.g. "loss/total"; their direction is theirs.
    objective: str | None = None


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=TMSConfig)
    layers: LayersConfig = field(default_factory=LayersConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0
    name: str = "run"


def check_positive(key: str, value: float, *, zero_ok: bool = False) -> None:
    """`value` > 0 (>= 0 with `zero_ok`) and finite, else a ConfigError naming `key` (the
    check a kind's `validate` uses for its own fields)."""
    bad = value < 0 if zero_ok else value <= 0
    if bad or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(key, value, "must be >= 0" if zero_ok else "must be > 0")


def expand_sites(patterns: Sequence[str], known: Sequence[str]) -> tuple[str, ...]:
    """`layers.sites` with patterns resolved against the target's sites (`known`, in their
    fixed order). An entry that is a site stays itself; otherwise its dotted parts are
    matched part by part against the start of each site: `A-B` any integer from A to B,
    `*` any one part, anything else itself. `layers.0-31.mlp` is every MLP matrix of
    layers 0-31, `layers.*.mlp.down_proj` every layer's down_proj, in the target's order."""
    out: list[str] = []
    for p in patterns:
        if p in known:
            out.append(p)
            continue
        parts = p.split(".")
        for part in parts:
            a, dash, b = part.partition("-")
            if dash and not (a.isdigit() and b.isdigit() and int(a) <= int(b)):
                raise ConfigError("layers.sites", p, f"'{part}': a range is A-B, integers "
                                  "with A <= B (layers.0-31.mlp)")
        matched = [s for s in known if _matches(parts, s.split("."))]
        if not matched:
            raise ConfigError("layers.sites", p, "names no site; a site or a pattern over "
                              f"them (layers.0-31.mlp, layers.*.mlp.down_proj): "
                              f"{', '.join(known[:6])}, ... ({len(known)} sites)")
        out.extend(matched)
    return tuple(out)


def expand_C(per_site: Mapping[str, int], sites: Sequence[str]) -> dict[str, int]:
    """`layers.C_per_site` by decomposed site. A key is a site, a pattern over them as in
    `layers.sites` (`layers.0-15.mlp`), or a matrix's own name (`k_proj`: that matrix in
    every layer); a later key wins over an earlier one. A key that names no decomposed
    site stays as it is, for the validation to name."""
    out: dict[str, int] = {}
    for key, c in per_site.items():
        parts = key.split(".")
        matched = [s for s in sites if s == key or (
            s.rsplit(".", 1)[-1] == key if len(parts) == 1 else _matches(parts, s.split(".")))]
        out.update(dict.fromkeys(matched or [key], c))
    return out


def _matches(pattern: list[str], site: list[str]) -> bool:
    if len(pattern) > len(site):
        return False
    for want, got in zip(pattern, site):
        a, dash, b = want.partition("-")
        if want == "*" or want == got:
            continue
        if not (dash and got.isdigit() and int(a) <= int(got) <= int(b)):
            return False
    return True


def rope_problem(rope: Any) -> tuple[str, Any, str] | None:
    """(field, value, what is allowed) for RoPE settings the Llama target would not compute,
    or None. The same rule for a preset's `model.rope_scaling` and a checkpoint's config.json
    (`rope_scaling` or `rope_parameters`), so a bad one never reaches the compiled step."""
    if not rope:
        return None
    if not isinstance(rope, Mapping):
        return "", rope, "must be a mapping with rope_type and its fields"
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        return "rope_type", kind, f"allowed: {', '.join(ROPE_TYPES)}"
    # transformers 5 keeps this among the RoPE parameters; it rotates part of each head only
    if rope.get("partial_rotary_factor", 1) != 1:
        return "partial_rotary_factor", rope["partial_rotary_factor"], (
            "allowed: 1.0 (RoPE over the whole head)")
    if kind == "llama3":
        for name in LLAMA3_ROPE_FIELDS:
            value = rope.get(name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                return name, value, (f"rope_type llama3 needs {', '.join(LLAMA3_ROPE_FIELDS)}, "
                                     "each a number > 0")
        if rope["high_freq_factor"] <= rope["low_freq_factor"]:
            return "high_freq_factor", rope["high_freq_factor"], (
                f"must be > low_freq_factor ({rope['low_freq_factor']}) for rope_type llama3")
    return None


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "",
              schema_of: Callable[[str], type] | None = None) -> Any:
    """Build the frozen dataclass `cls` from plain nested dicts (e.g. a resolved Hydra config).

    Unknown keys raise ConfigError naming the dotted key. `schema_of(kind)`: the dataclass
    of a `ModelConfig` value with that `kind` (`kinds.run_config` passes the kinds' own
    schemas; without it a model is read as the base `ModelConfig`).
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(dotted, value, f"unknown key; known: {', '.join(sorted(names))}")
        kwargs[key] = _convert(hints[key], value, dotted, schema_of)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, dotted: str,
             schema_of: Callable[[str], type] | None) -> Any:
    origin = typing.get_origin(tp)
    if tp is ModelConfig and isinstance(value, Mapping) and schema_of is not None:
        tp = schema_of(str(value.get("kind", ModelConfig.kind)))  # the model kind's schema
    if is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(dotted, value, f"must be a mapping of {tp.__name__} fields")
        return from_dict(tp, value, dotted + ".", schema_of)
    if origin is dict and isinstance(value, Mapping):
        _, vt = typing.get_args(tp)
        return {k: _convert(vt, v, f"{dotted}.{k}", schema_of) for k, v in value.items()}
    if origin is list and isinstance(value, (list, tuple)):
        (vt,) = typing.get_args(tp)
        return [_convert(vt, v, dotted, schema_of) for v in value]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(dotted, value, f"allowed: {', '.join(tp)}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(dotted, value, f"must be of type {tp.__name__}")
    return value
