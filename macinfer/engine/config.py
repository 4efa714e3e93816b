"""Engine options, how the KV budget is spent (plan_memory), and the prefix cache's disk tier for an engine."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from macinfer.errors import MacinferError
from macinfer.kv.quant import quantized_bytes_per_token
from macinfer.prefix_cache.dirs import label_prefix_dir, prefix_root
from macinfer.prefix_cache.disk import DiskPrefixStore
from macinfer.units import fmt_bytes, parse_bytes


@dataclass
class EngineConfig:
    """Engine options (what `LLM(model, **engine_options)` and the CLI pass).

    Args:
        kv_memory: KV pool budget, bytes or a string like "2GB"; None for the default.
        num_blocks: exact pool size in blocks (overrides kv_memory; tests, benchmarks).
        block_size: token slots per KV block.
        max_num_seqs: sequences decoding at once; None: 64, fewer for a model with recurrent state
            whose 64 slots would not fit the KV budget (plan_memory).
        max_num_batched_tokens: tokens per step (prefill chunk size + decodes).
        max_model_len: longest sequence; None for the model's context length.
        verbose: print the KV budget and capacity at start-up.
        enable_prefix_cache: reuse the K/V of full blocks shared with earlier
            prompts (macinfer.prefix_cache.keys); outputs are the same either way.
        persist_prefix_cache: also keep cached blocks on disk for later processes.
        prefix_cache_dir: root of the persistent tier (default $MACINFER_PREFIX_CACHE_DIR
            or cache_dir()/prefix); each model gets a subdirectory named by its identity.
        prefix_cache_disk_bytes: size limit of the persistent tier (all models together).
        draft: speculative decoding (macinfer.spec_decode.decoder): "ngram" (prompt lookup), a
            draft model (shipped draft name, path, catalog name, repo id, or a loaded
            mlx-lm model sharing the tokenizer), "<draft model>+ngram" (lookup where the
            text repeats itself, the model elsewhere), "auto" (the draft shipped for this
            model, if any, with lookup), or None for none.
        num_speculative_tokens: the most tokens drafted per sequence per step.
        adaptive_speculation: pick k each step from measured acceptance and costs
            (False: always draft num_speculative_tokens).
        kv_bits: store K/V quantised to 8 (or 4) bits in the paged pool
            (macinfer.kv.quant); None keeps the activation dtype.
        kv_group_size: quantisation group along head_dim (default 32).
        attention: "auto" (the fused Metal kernel if it passes its start-up check
            against the reference, else the reference), "metal" or "reference".
        async_scheduling: overlap building each decode step with the previous
            step's compute (module docstring); outputs are the same either way.
        eval_thread: evaluate launched decode steps on a worker thread (macinfer.core.evaluator);
            None: where that is what lets them overlap (MLX without Metal, one process).
        compile_decode: run batched decode forwards as compiled graphs, traced once per shape
            (macinfer.core.decode_graph); None: on MLX's CPU backend in one process, for a small model
            (each op's dispatch cost dominates its step), and there the verify forwards of speculative
            decoding (a few rows) for any model. Outputs are the same either way (checked at run time).
        state_snapshot_memory: models with recurrent state layers, prefix cache on: what the
            recurrent-state snapshots at block boundaries may hold (macinfer.core.state_snapshots),
            bytes or "256MB", out of the KV budget. None: one per state slot (max_num_seqs), at
            most a quarter of the budget the slots leave (with num_blocks: on top of it).
    """

    kv_memory: int | str | None = None
    num_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    verbose: bool = False
    enable_prefix_cache: bool = True
    persist_prefix_cache: bool = False
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int | str = "2GB"
    draft: object = None
    num_speculative_tokens: int = 12  # a ceiling: adaptive k goes this high on long copies (lookup)
    adaptive_speculation: bool = True
    kv_bits: int | None = None
    kv_group_size: int | None = None
    attention: str = "auto"
    async_scheduling: bool = True
    eval_thread: bool | None = None
    compile_decode: bool | None = None
    state_snapshot_memory: int | str | None = None

    def __post_init__(self):
        # Whether the caller chose max_num_seqs: a default may be lowered to fit state slots, a choice is not.
        self.max_num_seqs_given = self.max_num_seqs is not None
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise ValueError(f"num_blocks must be an integer >= 2, got {self.num_blocks}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        for name in ("eval_thread", "compile_decode"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(default_token_budget(mx.metal.is_available()), self.max_num_seqs)


DEFAULT_MAX_NUM_SEQS = 64


def default_token_budget(metal: bool) -> int:
    """Tokens per step unless set: how many prompt tokens a step may prefill beside its decodes.

    A chunk's forward delays every decode of its step, which argues for short chunks; but each
    forward also has a fixed cost (a graph built and run layer by layer), and recurrent layers
    (macinfer.kv.state_cache) step through a chunk one position at a time whatever its rows, so
    a forward costs about its padded length, not its token count. Short chunks then multiply
    the forwards: 16 prompts of 64 tokens take one step at 1024 and eight at 128. mlx-lm's
    BatchGenerator prefills up to 8 prompts x 2048 tokens a forward, vLLM 2048 tokens a step.
    Half that without Metal, where a forward of a given size takes longer.
    """
    return 2048 if metal else 1024


def wire_memory() -> bool:
    """On Metal, wire the recommended working set (mlx-lm's own call, as its generate and server do).

    Wired memory is not paged out under pressure, so the weights and KV pools stay resident
    between steps. A no-op without Metal. Returns whether the limit was set.
    """
    if not mx.metal.is_available():
        return False
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    return maybe_set_recommended_wired_limit() is not None


KV_SHARE_OF_MEMORY = 8  # the default KV budget is at most 1/8 of the machine's memory


def metal_device_info() -> dict | None:
    """MLX's Metal device info (memory_size, max_recommended_working_set_size, ...), None without Metal."""
    if not mx.metal.is_available():
        return None
    try:
        return mx.device_info()
    except AttributeError:
        return mx.metal.device_info()


def default_kv_memory(weight_bytes: int, device: dict | None = None) -> int:
    """The KV budget when none is given.

    On Metal: what the recommended working set leaves after the weights and a margin (1 GiB or a
    tenth of the working set, for activations and other apps), and at most an eighth of the
    machine's memory: 1 / 2 / 3 / 8 GiB on 8 / 16 / 24 / 64 GB Macs; never below 256 MiB. Without
    Metal (or without the sizes): 1 GiB.

    NOTE: the pool is allocated whole at start-up and does not grow (docs/platform.md, "KV pool
    size"), so the default is the size most sessions need, not all the memory there is: a
    working set's worth of KV for a 135M model on an 8 GB Mac pinned ~4 GB and pushed the rest
    of the system into swap. kv_memory / --kv-memory sets more.

    Args:
        device: MLX's device info (tests pass one); default `metal_device_info()`.
    """
    info = metal_device_info() if device is None else device
    working_set = int((info or {}).get("max_recommended_working_set_size", 0))
    if not working_set:
        return 1 << 30
    margin = max(1 << 30, working_set // 10)  # activations, other apps
    room = working_set - weight_bytes - margin
    memory = int(info.get("memory_size", 0))
    if memory:
        room = min(room, memory // KV_SHARE_OF_MEMORY)
    return max(256 << 20, room)


def prefix_store(config: EngineConfig, model_id: str, pool_caches: list, block_size: int, sync,
                 name: str | None = None, path: str | None = None) -> DiskPrefixStore | None:
    """The prefix cache's disk tier for an engine per config (persist_prefix_cache), or None.

    NOTE: the disk tier stores float K/V rows; quantised pools (kv_bits) stay in memory only.

    Args:
        sync: called before the store reads the pools (StepEvaluator.drain).
        name, path: the model's, for the directory's label (`macinfer cache`).
    """
    if not config.persist_prefix_cache or config.kv_bits:
        return None
    root = Path(config.prefix_cache_dir).expanduser() if config.prefix_cache_dir else prefix_root()
    store = DiskPrefixStore(root / model_id, model_id, pool_caches, block_size,
                            parse_bytes(config.prefix_cache_disk_bytes, "the prefix cache's disk budget"), sync=sync)
    if name is not None:
        label_prefix_dir(root, model_id, name, path)
    return store


@dataclass
class MemoryPlan:
    """How an engine's KV budget is spent (bytes), and the blocks and sequences it buys."""

    bytes_per_token: int
    bytes_per_block: int
    state_bytes: int  # recurrent-state slots, max_num_seqs of them (hybrid / SSM models)
    snapshot_bytes: int  # their prefix-cache snapshots
    kv_budget: int
    num_blocks: int
    max_num_seqs: int  # config.max_num_seqs, or fewer where state slots would not fit (see plan_memory)


def plan_memory(config: EngineConfig, specs, max_model_len: int, weight_bytes: int, model_type: str,
                device: dict | None = None) -> MemoryPlan:
    """Budget -> bytes per token and block, state slots and snapshots, and the number of KV blocks.

    A model with recurrent state layers takes a state slot per running sequence out of the budget
    first. When the default max_num_seqs' slots would not fit, fewer sequences run at once: as many
    as half the budget holds (one line on stderr says so); a max_num_seqs the caller chose is kept
    or refused.

    device: MLX's Metal device info for the default budget (`default_kv_memory`; tests pass one).

    Raises:
        MacinferError: the budget holds no block, or the recurrent state alone outgrows it.
    """
    bs = config.block_size
    if config.kv_bits:
        bytes_per_token = sum(quantized_bytes_per_token(s, config.kv_bits, config.kv_group_size) for s in specs)
    else:
        bytes_per_token = sum(s.bytes_per_token() for s in specs)
    bytes_per_block = bytes_per_token * bs
    states = getattr(specs, "states", None)
    per_slot = specs.bytes_per_slot if states else 0
    seqs = config.max_num_seqs
    # With the prefix cache on, state snapshots at block boundaries too (macinfer.core.state_snapshots):
    # state_snapshot_memory, or as many as there are slots, at most a quarter of what the slots leave.
    snapshots = bool(states) and config.enable_prefix_cache
    snapshot_bytes = 0
    if snapshots and config.state_snapshot_memory is not None:
        snapshot_bytes = parse_bytes(config.state_snapshot_memory, "the state snapshot memory")
    if config.num_blocks is not None:
        state_bytes = seqs * per_slot
        if snapshots and config.state_snapshot_memory is None:
            snapshot_bytes = state_bytes
        kv_budget = config.num_blocks * bytes_per_block + state_bytes + snapshot_bytes
        return MemoryPlan(bytes_per_token, bytes_per_block, state_bytes, snapshot_bytes, kv_budget, config.num_blocks,
                          seqs)
    kv_budget = (parse_bytes(config.kv_memory, "the KV memory budget") if config.kv_memory is not None
                 else default_kv_memory(weight_bytes, device))
    if seqs * per_slot >= kv_budget and not config.max_num_seqs_given and per_slot <= kv_budget // 2:
        fit = kv_budget // 2 // per_slot
        print(f"note: {model_type}: the recurrent state of {seqs} sequences ({fmt_bytes(seqs * per_slot, binary=True)}) "
              f"does not fit the {fmt_bytes(kv_budget, binary=True)} KV budget: at most {fit} sequences run at once "
              "(raise kv_memory for more)", file=sys.stderr)
        seqs = fit
    state_bytes = seqs * per_slot
    if state_bytes >= kv_budget:
        raise MacinferError(
            f"{model_type}: the recurrent state of {seqs} sequences takes "
            f"{fmt_bytes(state_bytes, binary=True)}, more than the {fmt_bytes(kv_budget, binary=True)} "
            "KV budget: raise kv_memory or lower max_num_seqs")
    if snapshots and config.state_snapshot_memory is None:
        snapshot_bytes = min(state_bytes, (kv_budget - state_bytes) // 4)
    if state_bytes + snapshot_bytes >= kv_budget:
        raise MacinferError(
            f"{model_type}: state snapshots of {fmt_bytes(snapshot_bytes, binary=True)} leave no room in "
            f"the {fmt_bytes(kv_budget, binary=True)} KV budget: lower state_snapshot_memory")
    # The null block counts against the budget; no point holding more than
    # max_num_seqs full-length sequences could fill.
    most = seqs * -(-max_model_len // bs) + 1
    num_blocks = (min(kv_budget - state_bytes - snapshot_bytes, most * bytes_per_block) // bytes_per_block
                  if bytes_per_block else min(1 << 16, most))  # no attention layers: blocks are free
    if num_blocks < 2:
        raise MacinferError(
            f"a KV budget of {fmt_bytes(kv_budget, binary=True)} holds no {bs}-token block "
            f"({fmt_bytes(bytes_per_block, binary=True)} each): raise kv_memory")
    return MemoryPlan(bytes_per_token, bytes_per_block, state_bytes, snapshot_bytes, kv_budget, num_blocks, seqs)
