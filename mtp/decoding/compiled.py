"""The verification pass compiled: the base model's forward over a fixed set of node counts, over a preallocated KV
cache, so that a pass over a tree costs about what the machine charges for streaming the weights once, not what
eager kernels and per-operation overhead charge.

Eager PyTorch pays per operation and multiplies a few rows by each weight matrix with kernels made for many; an
eager pass over 4 nodes of SmolLM2-135M cost 1.5 to 1.65 one-token passes on our 2-core CPUs. `torch.compile`
(inductor) fuses the small operations and, on a CPU, with the weights frozen as constants, packs each weight once
for the GEMM kernel it autotuned; on a GPU it replays the pass as a CUDA graph. Both need fixed shapes, so the
pass runs for a few node counts (`BUCKETS`: a tree is padded up to the next one with nodes that only see
themselves) over a cache of `LENGTH` slots allocated once (transformers' static cache layers): a pass writes its
nodes after the filled slots, `mtp.decoding.cache.keep_accepted` copies the accepted ones into place and the rest
are overwritten by the next pass. Nothing is compiled while decoding: every bucket is compiled when the decoder is
made (`warm_up`).

One row at a time: when a second row joins a batch, or a pass would run past the cache's end, the cache moves into
a dynamic one and passes run eagerly from there on (`mtp.decoding.batch`); a pass over more nodes than the largest
bucket runs eagerly over the static cache. The compiled pass computes the same function as the eager one: float32
logits agree to rounding (tests/test_compiled.py), so greedy output is plain greedy output.

The compiled pass is kept under mtp's cache folder (inductor's FX graph cache, the generated kernels and the
autotuned choices), so a later process traces and freezes the model again but compiles nothing: 20 s a node count
for SmolLM2 on the 2-core Zen 4 EPYC, against 60 s the first time. For that the linears stay matrix products of
the frozen weights (`_unpacked_linears`) and the CPU's vector instructions are checked once per machine
(`_vector_isa`). The cache's key holds the graph and the settings, not the weights' values: a model of the same
shapes with other weights loads the same pass and runs it on its own weights (tried on SmolLM2 with every matrix
changed: logits within 4e-5 of the eager pass's). Each pass made in a process has graphs of its own.
"""

import os
import sys
import time
import weakref
from functools import partial

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from mtp.decoding.cache import grouped_keys, tree_attention_mask
from mtp.decoding.target import States, Target
from mtp.linears import usual_linears
from mtp.machine import cache_dir, device_name, measured

BUCKETS = (1, 4, 8)  # node counts compiled, a tree padded up to the next (each 1 min to compile on 2 cores; 16 nodes
# compiled ran no faster than eagerly on the Zen 4 EPYC: docs/reference-runs.md#compiled-passes)
LENGTH = 1024  # cache slots: prompt, answer and one pass's nodes must fit
INDUCTOR_DIR = "TORCHINDUCTOR_CACHE_DIR"


class CompiledPass:
    """The base model's verification pass over one row, compiled for each of `buckets` node counts, over a
    static cache of `length` slots.

    Args:
        target: the base model as the verifier sees it.
        every_layer: passes give every layer's hidden states too (for a drafter that reads features).
        buckets: node counts to compile, ascending.
        length: cache slots.
        tune: on a CPU, autotune each product's kernel among inductor's C++ GEMM templates and oneDNN/MKL (the
            templates win for a few rows); False compiles faster (tests).
    """

    def __init__(self, target: Target, every_layer: bool = False, buckets: tuple[int, ...] = BUCKETS,
                 length: int = LENGTH, tune: bool = True):  # fmt: skip
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets={buckets}: give node counts from 1 up, ascending, each once.")
        self.target, self.every_layer, self.buckets = target, every_layer, tuple(buckets)
        self.length = min(length, target.context or length)
        self.cache = _SeenCache(layers=[StaticLayer(self.length) for _ in range(target.num_layers)])
        if os.environ.get(INDUCTOR_DIR, default_cache_dir()) == default_cache_dir():  # unless the user chose one
            os.environ[INDUCTOR_DIR] = str(cache_dir() / "inductor")  # kernels and autotuning kept beside mtp's
        torch._dynamo.config.recompile_limit += 2 * len(buckets) + 2  # graphs of every pass made in the process
        # inductor's settings for tracing and compiling, set around each call: `torch.compile(options=...)` would
        # not freeze the weights (the tracer reads `freezing` from the global config)
        self.settings = {"freezing": True}
        if target.device.type == "cuda":  # replayed as a CUDA graph: one launch per pass
            self.settings["triton.cudagraphs"] = True
        else:
            self.settings |= {"max_autotune": tune, "max_autotune_gemm_backends": "CPP,ATEN",
                              "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
            # (no table nor line per product on stderr)
            self.settings |= _vector_isa()
            _unpacked_linears()
        self._holder = None  # a weak reference to the batch decoding on the static cache
        # a class of its own: the one guard kept on the module is its type, which finds this pass's graphs (its
        # frozen weights, its cache), not those of another pass compiled in the process
        self._forward = type("_Pass", (_Pass,), {})(target, self.cache, every_layer)
        self._compiled = torch.compile(self._forward, dynamic=False, options={"guard_filter_fn": _guards})

    def claim(self, batch, filled: int) -> bool:
        """Give the static cache to the lone row of `batch` (`mtp.decoding.batch.Batch`), `filled` slots long, unless
        its drafters read hidden states this pass does not give, it does not fit, or another batch still decodes on
        the cache (two streams of one decoder interleaved: the second decodes eagerly)."""
        holder = self._holder and self._holder()
        taken = holder is not None and holder is not batch and holder.static
        if taken or (batch.every_layer and not self.every_layer) or not self.holds(filled, 1):
            return False
        self._holder = weakref.ref(batch)
        return True

    def holds(self, filled: int, queries: int) -> bool:
        """Whether the static cache has room for a pass over `queries` nodes after `filled` slots."""
        return filled + (self.bucket(queries) or queries) < self.length  # the last slot unused: one graph for all T

    def bucket(self, queries: int) -> int | None:
        """The node count a pass over `queries` nodes is padded to; None: more than the largest bucket."""
        return next((size for size in self.buckets if size >= queries), None)

    def load(self, cache: DynamicCache) -> Cache:
        """This pass's static cache holding what the one-row `cache` holds (a prefill's), in its first slots."""
        for layer, filled in zip(self.cache.layers, cache.layers, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(filled.keys, filled.values)
            length = filled.keys.shape[2]
            layer.keys[:, :, :length] = filled.keys  # (1, G, T, D)
            layer.values[:, :, :length] = filled.values
            layer.cumulative_length.fill_(length)
        return self.cache

    def unload(self, filled: int) -> DynamicCache:
        """A dynamic cache with the first `filled` slots of the static one (for eager steps from here on)."""
        cache = DynamicCache()
        for index, layer in enumerate(self.cache.layers):
            cache.update(layer.keys[:, :, :filled].clone(), layer.values[:, :, :filled].clone(), index)
        return cache

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, slots: torch.Tensor,
            every_layer: bool = False) -> States:  # fmt: skip
        """One pass over the nodes `tokens` (1, Q) at `positions` (1, Q), node i seeing node j iff `tree_mask`
        (1, Q, Q), after the filled slots `slots` (1, T) of the static cache: their states (every layer's if
        `every_layer`) and logits. Compiled, the pass is padded to its bucket; over more nodes than the largest bucket,
        it runs eagerly. The cache then holds T + the pass's nodes (padding included) slots."""
        queries, filled, bucket = tokens.shape[1], slots.shape[1], self.bucket(tokens.shape[1])
        size = bucket or queries
        pad = size - queries
        tokens = F.pad(tokens, (0, pad))  # (1, S) padded nodes: token 0 at position 0, seeing only itself
        positions = F.pad(positions, (0, pad))
        tree_mask = F.pad(tree_mask, (0, pad, 0, pad)) | torch.eye(size, dtype=torch.bool, device=tokens.device)
        mask = tree_attention_mask(tree_mask, positions, slots, self.target.windows, self.target.dtype)
        if mask is None:  # one node after filled slots, no window: eagerly the model's own path, here a mask
            mask = torch.zeros(1, 1, size, filled + size, dtype=self.target.dtype, device=tokens.device)
        for each in mask.values() if isinstance(mask, dict) else [mask]:  # (1, 1, S, T+S): one compiled graph for
            torch._dynamo.mark_dynamic(each, 3, min=2, max=self.length - 1)  # every T (attention reads T+S slots)
        forward = self._compiled if bucket else self._forward
        backbone, lm_head = self.target.backbone, self.target.lm_head  # traced with the usual products, which it packs
        with grouped_keys(self.target.device.type == "cpu"), usual_linears(backbone), usual_linears(lm_head), \
                inductor.patch(self.settings):  # fmt: skip
            hidden, logits, states = forward(tokens, positions, mask)
        if every_layer and states is None:
            raise ValueError("This compiled pass gives no hidden states but the last: build it with every_layer=True.")
        states = tuple(layer[:, :queries] for layer in states) if every_layer else None
        return States(hidden[:, :queries], states, logits[:, :queries])

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile every bucket now, on a cache of a few dummy tokens, saying in one line what it took."""
        start = time.perf_counter()
        context = 8
        prefill = DynamicCache()
        tokens = torch.zeros(1, context, dtype=torch.long, device=self.target.device)
        # (with the layers' states: transformers hooks them now, not traced)
        self.target.run(self.every_layer, input_ids=tokens, cache=prefill)
        print(f"mtp: compiling the verification pass for {', '.join(map(str, self.buckets))} nodes on "
              f"{self.target.device.type} (kept in {os.environ[INDUCTOR_DIR]} for later processes)",
              end="", file=sys.stderr, flush=True)  # fmt: skip
        slots = torch.arange(context, device=self.target.device)[None]
        for size in self.buckets:
            self.load(prefill)
            step = time.perf_counter()
            nodes = torch.zeros(1, size, dtype=torch.long, device=self.target.device)
            self.run(nodes, context + torch.arange(size, device=nodes.device)[None],
                     torch.ones(1, size, size, dtype=torch.bool, device=nodes.device).tril(), slots)  # fmt: skip
            print(f" {size}: {time.perf_counter() - step:.0f} s", end="", file=sys.stderr, flush=True)
        print(f"; {time.perf_counter() - start:.0f} s in all", file=sys.stderr)


def _unpacked_linears() -> None:
    """Keep the linear products as matrix products when freezing (no weight packed for MKL), for the process.
    Packed, each weight becomes a oneDNN tensor that inductor's cache cannot save, so every process compiled the
    whole pass again (60 s a node count on the 2-core Zen 4 EPYC); as products of frozen weights, the C++ GEMM
    templates are still autotuned against ATen's and the compiled pass is kept on disk. (Inductor registers its
    freezing passes once per process, here without the packing; a pass compiled before in the process keeps it.)"""
    from torch._inductor.fx_passes.freezing_patterns import lazy_init

    with inductor.patch({"cpp.weight_prepack": False}):
        lazy_init()


def _vector_isa() -> dict:
    """Inductor's setting for the CPU's vector instructions. Inductor checks every instruction set the CPU reports
    by compiling a program and loading it in a child Python, in every process (24 s on the 2-core Zen 4 EPYC); mtp
    lets it check once per machine and torch version (kept in `$MTP_CACHE/vector_isa.json`), and later trusts what
    the CPU reports while that names the same instruction set. {} where the user set `cpp.vec_isa_ok`."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list

    if inductor.cpp.vec_isa_ok is not None:
        return {}
    key = f"{device_name('cpu')}, torch {torch.__version__}"
    checked = measured("vector_isa.json", key, lambda: str(pick_vec_isa()))
    valid_vec_isa_list.cache_clear()  # computed again under the setting that applies
    with inductor.patch({"cpp.vec_isa_ok": True}):
        trusted = str(pick_vec_isa()) == checked
    valid_vec_isa_list.cache_clear()
    return {"cpp.vec_isa_ok": True} if trusted else {}


def _guards(entries) -> list[bool]:
    """The compiled pass's guards: on its inputs and the module's type only. Checking every attribute of the model
    before each pass cost 1.2 ms of a 23 ms one (SmolLM2, the 2-core Zen 4 EPYC)."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    own_type = [(entry.name, entry.guard_type) == ("self", "TYPE_MATCH") for entry in entries]
    return [kept or own for kept, own in zip(keep, own_type, strict=True)]


class _SeenCache(Cache):
    """A static cache whose layers give attention only the slots a pass sees, the first `seen` (its mask's length),
    not every slot: attending 1024 slots after 256 filled cost 4 of a one-node pass's 23 ms, 9 of an 8-node pass's
    41 (SmolLM2, the 2-core Zen 4 EPYC)."""

    seen: int | torch.SymInt = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return keys[:, :, : self.seen], values[:, :, : self.seen]  # (1, G, seen, D) each


class _Pass(torch.nn.Module):
    """The pass that is compiled: the backbone over the static `cache`, then the logits as the model makes them.
    A module holding the model's modules, so that the compiler sees their weights as parameters, which it freezes."""

    def __init__(self, target: Target, cache: Cache, every_layer: bool):
        super().__init__()
        self.backbone, self.lm_head, self.cache, self.every_layer = target.backbone, target.lm_head, cache, every_layer
        self.finish = partial(target.finished, scale=target.scale, divide=target.divide)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask) -> tuple:
        """(last hidden states, logits, every layer's hidden states or None), the pass's keys and values written
        after the cache's filled slots."""
        self.cache.seen = next(iter(mask.values())).shape[-1] if isinstance(mask, dict) else mask.shape[-1]
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=self.cache,
                            use_cache=True, output_hidden_states=self.every_layer)  # fmt: skip
        hidden = out.last_hidden_state
        return hidden, self.finish(self.lm_head(hidden)), out.hidden_states if self.every_layer else None


def compile_pass(base_model, compile: bool | None = None, every_layer: bool = False) -> CompiledPass | None:
    """`base_model`'s verification pass (with every layer's hidden states if `every_layer`) compiled and warmed up if
    `compile` (None: unless the environment sets MTP_COMPILE=0); None if not, or if compiling fails (then said in
    one line: decoding steps run eagerly)."""
    if compile is None:
        compile = os.environ.get("MTP_COMPILE", "1") != "0"
    if not compile:
        return None
    compiled = CompiledPass(Target(base_model), every_layer)
    try:
        compiled.warm_up()
    except Exception as error:  # a model or device that inductor cannot compile: eager steps, as before
        print(f"\nmtp: could not compile {base_model.config.model_type}'s verification pass "
              f"({error.__class__.__name__}: {str(error).splitlines()[0][:200]}): decoding steps run eagerly",
              file=sys.stderr)  # fmt: skip
        return None
    return compiled
