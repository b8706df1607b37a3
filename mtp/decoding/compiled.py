"""The verification pass compiled: the base model's forward over a fixed set of node counts, over a preallocated KV
cache, so that a pass over a tree costs about what the machine charges for streaming the weights once, not what
eager kernels and per-operation overhead charge.

Eager PyTorch pays per operation and multiplies a few rows by each weight matrix with kernels made for many, so an
eager pass over a few nodes costs well over one a token. Inductor fuses the
small operations and, on a CPU, with the weights frozen as constants, packs each weight once into the blocks of its
C++ GEMM template for the pass's shapes; on a GPU `torch.compile` replays the pass as a CUDA graph. Both need fixed
shapes, so the pass runs for a few node counts (`BUCKETS`: a tree is padded up to the next one with nodes that only
see themselves) over a cache of `LENGTH` slots allocated once (transformers' static cache layers): a pass writes its
nodes after the filled slots, `mtp.decoding.cache.keep_accepted` copies the accepted ones into place and the rest
are overwritten by the next pass. Nothing is compiled while decoding: every bucket is compiled when the decoder is
made (`warm_up`).

One row at a time: when a second row joins a batch, or a pass would run past the cache's end, the cache moves into
a dynamic one and passes run eagerly from there on (`mtp.decoding.batch`); a pass over more nodes than the largest
bucket runs eagerly over the static cache. The compiled pass computes the same function as the eager one: float32
logits agree to rounding (tests/test_compiled.py), so greedy output is plain greedy output.

On a CPU the pass is exported (`torch.export`) once for all buckets, the node count a dimension of its inputs, and
compiled ahead of time into one AOTInductor package, with the static cache's tensors as inputs that it writes in place.
The weights are frozen while it compiles (so that inductor packs each linear weight into its template's blocks) but not
kept in it: the package's constants are the model's own tensors, given to it at load (`mtp.decoding.constants`), and a
decoder layer's linear whose weight the package reads in blocks alone then holds it in those blocks alone
(`constants.PanelLinear`, whose eager products multiply by them in mtp's kernel): the process holds the weights once. It
is kept under mtp's cache folder (`passes/`, about 4 MB for SmolLM2), keyed by the machine, torch, transformers, the
model's configuration and its weights, the buckets: the first load on a machine compiles (minutes), a later process
loads it in seconds. A decoder compiles the buckets it can use (plain decoding: bucket 1 alone, `compile_pass`). A
package runs no Python and checks no guards between kernels. Inductor's settings for it, and its patches of inductor's
code generation (the linears kept matrix products of the frozen weights, the micro-kernel's accumulators in registers, 8
rows at once, the CPU's vector instructions checked once per machine), are in `mtp.internals`.
"""

import hashlib
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from contextlib import ExitStack
from functools import cached_property, partial
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from mtp import internals
from mtp.decoding import constants
from mtp.decoding.cache import grouped_keys, tree_attention_mask
from mtp.decoding.target import PassStates, Target
from mtp.linears import usual_linears
from mtp.machine import cache_dir, device_name

BUCKETS = (1, 4, 8)  # node counts compiled, a tree padded up to the next (16 nodes compiled ran no faster than
# eagerly: docs/reference-runs.md#compiled-passes)
LENGTH = 1024  # cache slots: prompt, answer and one pass's nodes must fit
INDUCTOR_DIR = "TORCHINDUCTOR_CACHE_DIR"
PACKAGES = 7  # the version of a packaged pass's code, in its key: raised when a change alters what a package computes
# or how fast


class CompiledPass:
    """The base model's verification pass over one row, compiled for each of `buckets` node counts, over a
    static cache of `length` slots.

    Args:
        target: the base model as the verifier sees it.
        every_layer: passes give every layer's hidden states too (for a drafter that reads features).
        buckets: node counts to compile, ascending.
        length: cache slots.
        templates: on a CPU, the products as inductor's C++ GEMM templates for their shapes, each weight packed into
            the template's blocks, not autotuned against ATen's products (False: ATen's products alone, which
            compile faster: tests). Autotuning times each product alone with its weight in the CPU's cache, where the
            pass streams every weight from memory, and chose products that made the pass slower
            (docs/reference-runs.md#compiled-passes).
    """

    def __init__(
        self,
        target: Target,
        every_layer: bool = False,
        buckets: tuple[int, ...] = BUCKETS,
        length: int = LENGTH,
        templates: bool = True,
    ):
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets={buckets}: give node counts from 1 up, ascending, each once.")
        self.target, self.every_layer, self.buckets = target, every_layer, tuple(buckets)
        self.length = min(length, target.context or length)
        self.cache = _SeenCache(layers=[StaticLayer(self.length) for _ in range(target.num_layers)])
        if os.environ.get(INDUCTOR_DIR, internals.inductor_cache_default()) == internals.inductor_cache_default():
            os.environ[INDUCTOR_DIR] = str(cache_dir() / "inductor")  # kernels and autotuning kept beside mtp's
        # inductor's settings for tracing and compiling, set around each call: `torch.compile(options=...)` would
        # not freeze the weights (the tracer reads `freezing` from the global config)
        self.settings = {"freezing": True}
        if target.device.type == "cuda":  # replayed as a CUDA graph: one launch per pass
            self.settings["triton.cudagraphs"] = True
        else:
            self.settings |= internals.cpu_pass_settings(templates)
        self._holder = None  # a weak reference to the batch decoding on the static cache
        self._claiming, self._outgrown = threading.Lock(), False
        # a class of its own: the one guard kept on the module is its type, which finds this pass's graphs (its
        # frozen weights, its cache), not those of another pass compiled in the process
        self._forward = type("_Pass", (_Pass,), {})(target, self.cache, every_layer)
        self._packaged = target.device.type == "cpu"  # one AOTInductor package for every bucket (CPU)
        self._package_loaded = None
        self._compiled = None
        if not self._packaged:
            internals.allow_recompiles(2 * len(buckets) + 2)  # graphs of every pass made in the process
            self._compiled = torch.compile(self._forward, dynamic=False, options={"guard_filter_fn": _guards})

    def claim(self, batch, filled: int) -> bool:
        """Give the static cache to the lone row of `batch` (`mtp.decoding.batch.Batch`), `filled` slots long, unless
        its drafters read hidden states this pass does not give, it does not fit (said once), or another batch holds
        the cache (two streams of one decoder interleaved, or two threads decoding: the second decodes eagerly). The
        batch holds it until `release`."""
        if batch.every_layer and not self.every_layer:
            return False
        if not self.holds(filled, 1):
            self.outgrown(filled)
            return False
        with self._claiming:
            holder = self._holder and self._holder()
            if holder is not None and holder is not batch:
                return False
            self._holder = weakref.ref(batch)
        return True

    def release(self, batch) -> None:
        """`batch` no longer decodes on the static cache: the next batch may claim it."""
        with self._claiming:
            if self._holder is not None and self._holder() is batch:
                self._holder = None

    def outgrown(self, filled: int) -> None:
        """Say, once per pass, that a row of `filled` slots outgrows the static cache, so its steps run eagerly."""
        if not self._outgrown:
            self._outgrown = True
            print(
                f"mtp: a row of {filled} tokens outgrows the compiled pass's {self.length} slots: its steps run "
                "eagerly from here (the same output, slower)",
                file=sys.stderr,
            )

    def holds(self, filled: int, queries: int) -> bool:
        """Whether the static cache has room for a pass over `queries` nodes after `filled` slots."""
        return filled + (self.bucket(queries) or queries) < self.length  # the last slot unused: one graph for all T

    def bucket(self, queries: int) -> int | None:
        """The node count a pass over `queries` nodes is padded to; None: more than the largest bucket."""
        return next((size for size in self.buckets if size >= queries), None)

    def load(self, cache: DynamicCache) -> Cache:
        """This pass's static cache holding what the one-row `cache` holds (a prefill's), in its first slots."""
        if not self.cache.layers[0].is_initialized:  # first use: the layers' tensors, of this model's shapes
            for layer, filled in zip(self.cache.layers, cache.layers, strict=True):
                layer.lazy_initialization(filled.keys, filled.values)
            if self._packaged:  # (a graph compiled by `torch.compile` takes them as inputs: not aliased)
                self.cache.stacked = _stacked(self.cache.layers)
                self.cache.lengths = torch.stack([layer.cumulative_length for layer in self.cache.layers])
                for layer, view in zip(self.cache.layers, self.cache.lengths, strict=True):
                    layer.cumulative_length = view
        for layer, filled in zip(self.cache.layers, cache.layers, strict=True):
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

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor,
        slots: torch.Tensor,
        every_layer: bool = False,
    ) -> PassStates:
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
        if bucket and self._packaged:
            inputs = (tokens, positions, mask, *self._state())
            hidden, logits, states = self._package(inputs)(*inputs)
        else:
            for each in mask.values() if isinstance(mask, dict) else [mask]:  # (1, 1, S, T+S): one graph for every
                internals.mark_dynamic(each, 3, 2, self.length - 1)  # T (attention reads T+S slots)
            with self._tracing():
                hidden, logits, states = (self._compiled if bucket else self._forward)(tokens, positions, mask)
        if every_layer and states is None:
            raise ValueError("This compiled pass gives no hidden states but the last: build it with every_layer=True.")
        states = tuple(layer[:, :queries] for layer in states) if every_layer else None
        return PassStates(hidden[:, :queries], states, logits[:, :queries])

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the pass now (traced over the largest bucket) and run every bucket once, on a cache of a few dummy
        tokens, saying in one line what it took."""
        start = time.perf_counter()
        context = 8
        prefill = DynamicCache()
        tokens = torch.zeros(1, context, dtype=torch.long, device=self.target.device)
        # (with the layers' states: transformers hooks them now, not traced)
        self.target.run(self.every_layer, input_ids=tokens, cache=prefill)
        counts, folder = ", ".join(map(str, self.buckets)), cache_dir() / "passes"
        if self._packaged and self._package_path().is_file():
            said = f"loading the verification pass compiled for {counts} nodes (from {folder})"
        else:
            kept = folder if self._packaged else os.environ[INDUCTOR_DIR]
            said = (
                f"compiling the verification pass for {counts} nodes on {self.target.device.type} (kept in {kept} "
                "for later processes)"
            )
        print(f"mtp: {said}", end="", file=sys.stderr, flush=True)
        slots = torch.arange(context, device=self.target.device)[None]
        for size in reversed(self.buckets):  # the largest first: the package is traced over it
            self.load(prefill)
            step = time.perf_counter()
            nodes = torch.zeros(1, size, dtype=torch.long, device=self.target.device)
            self.run(
                nodes,
                context + torch.arange(size, device=nodes.device)[None],
                torch.ones(1, size, size, dtype=torch.bool, device=nodes.device).tril(),
                slots,
            )
            print(f" {size}: {time.perf_counter() - step:.0f} s", end="", file=sys.stderr, flush=True)
        print(f"; {time.perf_counter() - start:.0f} s in all", file=sys.stderr)

    def _tracing(self) -> ExitStack:
        """The settings the pass is traced and compiled under: grouped keys on a CPU (see `grouped_keys`), the usual
        products (which inductor packs itself) and inductor's settings."""
        stack = ExitStack()
        for context in (
            grouped_keys(self.target.device.type == "cpu"),
            usual_linears(self.target.backbone),
            usual_linears(self.target.lm_head),
            internals.inductor_settings(self.settings),
        ):
            stack.enter_context(context)
        return stack

    def _state(self) -> list[torch.Tensor]:
        """The static cache's tensors, as a package takes them: each layer's keys, values and filled length."""
        return [t for layer in self.cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]

    def _package(self, inputs: tuple):
        """The pass as one AOTInductor package for every bucket (the node count a dimension of its inputs), loaded:
        from mtp's cache folder if a process made it before for this model, else exported from `inputs` (a pass's
        tokens, positions, mask and `_state()`), compiled now and kept there; its constants the model's own tensors
        (`mtp.decoding.constants`)."""
        if self._package_loaded is not None:
            return self._package_loaded
        path = self._package_path()
        if not path.is_file():
            tokens, mask = inputs[0], inputs[2]
            low, high = self.buckets[0], self.buckets[-1]
            nodes = torch.export.Dim("nodes", min=low, max=high) if high > low else None
            seen = torch.export.Dim("seen", min=low + 1, max=self.length - 1)  # every filled length
            per_mask = {2: nodes, 3: seen} if nodes is not None else {3: seen}
            shapes = {name: per_mask for name in mask} if isinstance(mask, dict) else per_mask
            rows = {1: nodes} if nodes is not None else None
            if tokens.shape[1] != high:  # traced at the largest bucket: its products' blocks chosen for most rows
                raise ValueError(f"the package is exported from a pass over {high} nodes, not {tokens.shape[1]}")
            with self._tracing():
                inputs = (*inputs[:3], *(t.clone() for t in inputs[3:]))  # traced apart: no views of one tensor
                exported = torch.export.export(
                    _CacheInputs(self._forward, self.cache),
                    inputs,
                    strict=False,
                    dynamic_shapes=(rows, rows, shapes, (None,) * (len(inputs) - 3)),
                )
                path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=path.parent) as staging, internals.recorded() as made:
                    package = _compile(exported, f"{staging}/{path.name}", self.settings)
                    constants.save(path, *constants.recipes_for(made, self._tensors))
                    made.clear()
                    os.replace(package, path)  # written aside, then renamed: never half a package
            del exported
            constants.free_memory()  # what compiling took
        package = internals.load_package(str(path))
        reported = package.get_constant_fqns()
        self._constants = constants.supply(path, self._tensors, reported, self._forward.backbone, "backbone")
        package.loader.update_constant_buffer(self._constants, False, True, True)  # (all of them, user-managed)
        self._package_loaded = package
        return package

    @property
    def _tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers that the pass reads, by name."""
        return dict(self._forward.named_parameters()) | dict(self._forward.named_buffers())

    def _package_path(self) -> Path:
        """Where the package of the pass is kept: keyed by the machine, torch and transformers, the model's
        configuration and weights, the cache's length, the buckets and what the pass
        gives."""
        key = hashlib.sha256()
        parts = [
            device_name(self.target.device),
            torch.__version__,
            transformers.__version__,
            self.target.dtype,
            self.target.backbone.config.to_json_string(),
            self.length,
            self.every_layer,
            sorted(self.settings.items()),
            PACKAGES,
            self.buckets,
        ]
        key.update(repr(parts).encode() + self._weights_digest)
        return cache_dir() / "passes" / f"{key.hexdigest()[:24]}-{'-'.join(map(str, self.buckets))}.pt2"

    @cached_property
    def _weights_digest(self) -> bytes:
        """The weights as the packages' key holds them: each tensor's name and `_moments` of its values, which do not
        change when a layer comes to hold its weight in blocks (`constants.PanelLinear`), so that a later pass over
        the same model finds the package made before."""
        named = {re.sub(r"\.blocks$", ".weight", name): tensor for name, tensor in self._tensors.items()}
        return "\n".join(f"{name} {_moments(tensor)}" for name, tensor in sorted(named.items())).encode()


MODULUS = 2_147_483_629  # a prime below 2^31: `_moments` sums exactly in 64-bit integers


def _moments(tensor: torch.Tensor) -> tuple[int, int, int]:
    """The sums of a tensor's values (their bits as integers) and of their squares and cubes, modulo MODULUS: exact,
    so the same in any order of the values (a weight, or its blocks with rows of zeros added)."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    sums = [0, 0, 0]
    for part in tensor.detach().reshape(-1).view(bits).split(1 << 20):
        value = part.long() % MODULUS
        square = value * value % MODULUS
        for i, each in enumerate((value, square, square * value % MODULUS)):
            sums[i] = (sums[i] + int(each.sum())) % MODULUS
    return tuple(sums)


def _compile(exported, path: str, settings: dict) -> str:
    """`exported` compiled into an AOTInductor package at `path` under inductor's `settings`. Where the C++ GEMM
    templates alone cannot compute every product (a product of two activations, as attention written as matrix
    products computes), the products are autotuned against ATen's instead."""
    try:
        return internals.compile_package(exported, path, settings)
    except Exception as error:
        causes = [error]
        while causes[-1].__cause__ or causes[-1].__context__:
            causes.append(causes[-1].__cause__ or causes[-1].__context__)
        if not any(type(cause).__name__ == "NoValidChoicesError" for cause in causes):
            raise
    return internals.compile_package(exported, path, settings | {"max_autotune_gemm_backends": "CPP,ATEN"})


def _guards(entries) -> list[bool]:
    """The compiled pass's guards: on its inputs and the module's type only. Checking every attribute of the model
    before each pass costs a few percent of a pass."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    own_type = [(entry.name, entry.guard_type) == ("self", "TYPE_MATCH") for entry in entries]
    return [kept or own for kept, own in zip(keep, own_type, strict=True)]


class _SeenCache(Cache):
    """A static cache whose layers give attention only the slots a pass sees, the first `seen` (its mask's length),
    not every slot: attending every slot of a long cache costs a large share of a pass early in an answer."""

    seen: int | torch.SymInt = 0
    stacked: list[torch.Tensor] | None = None
    """Every layer's keys as views of one tensor, its values of another ((layers, 1, G, slots, D) each), so that a
    step's accepted nodes move in every layer at once (`mtp.decoding.cache.keep_accepted`); None: apart."""
    lengths: torch.Tensor | None = None
    """(layers,) every layer's filled length (its `cumulative_length` a view of it), set at once after a step (one
    in-place op, not one per layer); None: apart."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return keys[:, :, : self.seen], values[:, :, : self.seen]  # (1, G, seen, D) each


def _stacked(layers: list[StaticLayer]) -> list[torch.Tensor] | None:
    """The static `layers`' keys and values made views of two tensors (`_SeenCache.stacked`), each layer's part
    contiguous as before; None, the layers left apart, if their shapes differ. Moved at once, a step's accepted
    nodes take one gather and one copy, not two a layer."""
    stacked = []
    for name in ("keys", "values"):
        own = [getattr(layer, name) for layer in layers]
        if len({(t.shape, t.dtype) for t in own}) > 1:
            return None
        stacked.append(torch.stack(own))  # (layers, 1, G, slots, D)
        for layer, view in zip(layers, stacked[-1], strict=True):
            setattr(layer, name, view)
    return stacked


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
        out = self.backbone(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.every_layer,
        )
        hidden = out.last_hidden_state
        return hidden, self.finish(self.lm_head(hidden)), out.hidden_states if self.every_layer else None


class _CacheInputs(torch.nn.Module):
    """The pass with the static cache's tensors as inputs (`CompiledPass._state`), its keys and values written into
    them in place: exported code keeps no Python state. Each layer's own tensors come back after tracing."""

    def __init__(self, forward: _Pass, cache: Cache):
        super().__init__()
        self.forward_pass, self.layers = forward, cache.layers

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask, *state: torch.Tensor) -> tuple:
        own = [(layer.keys, layer.values, layer.cumulative_length) for layer in self.layers]
        try:
            for index, layer in enumerate(self.layers):
                layer.keys, layer.values, layer.cumulative_length = state[3 * index : 3 * index + 3]
            return self.forward_pass(input_ids, position_ids, mask)
        finally:
            for layer, tensors in zip(self.layers, own, strict=True):
                layer.keys, layer.values, layer.cumulative_length = tensors


def compile_pass(
    base_model, compile: bool | None = None, every_layer: bool = False, nodes: int = BUCKETS[-1]
) -> CompiledPass | None:
    """`base_model`'s verification pass (with every layer's hidden states if `every_layer`) compiled and warmed up if
    `compile` (None: unless the environment sets MTP_COMPILE=0), for the buckets a decoder that verifies at most
    `nodes` nodes a pass can use (plain decoding: 1, one bucket); None if not, or if compiling fails (then said in
    one line: decoding steps run eagerly)."""
    if compile is None:
        compile = os.environ.get("MTP_COMPILE", "1") != "0"
    if not compile:
        return None
    buckets = BUCKETS[: sum(size < nodes for size in BUCKETS) + 1]  # up to the first that holds `nodes`
    try:
        compiled = CompiledPass(Target(base_model), every_layer, buckets)
        compiled.warm_up()
    except Exception as error:  # a model, device or torch that inductor cannot compile for: eager steps, as before
        print(
            f"\nmtp: could not compile {base_model.config.model_type}'s verification pass "
            f"({error.__class__.__name__}: {str(error).splitlines()[0][:200]}): decoding steps run eagerly",
            file=sys.stderr,
        )
        return None
    return compiled
