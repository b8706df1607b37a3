"""What mtp reaches for inside torch and transformers that they do not publish, in one place: private attributes,
operators and entry points, and the patches of inductor's code generation that make the compiled pass fast on a CPU.
Nothing else in mtp touches a name that begins with an underscore in torch, inductor or transformers (a test reads
the sources).

The patches are written for the torch releases in `TORCH`, and tested on the lowest (CI runs the suite on it): on
another torch they are skipped, and one line says what speed that costs; where one fails, the same. The pass is
then compiled as inductor makes it, or, where compiling fails, runs eagerly (`mtp.decoding.compiled.compile_pass`
says why in one line); `import mtp` reaches none of them.
"""

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

from mtp.machine import device_name, measured

TORCH = ("2.13",)  # the torch releases (major.minor) the patches below were written and tested for


def version(tensor: torch.Tensor) -> int:
    """How many times `tensor` was changed in place (torch's counter, for caches of what is computed from a weight);
    0 for an inference tensor, which keeps no counter: made under `torch.inference_mode()`, it can change only
    there, and a cache of it is not renewed."""
    return 0 if tensor.is_inference() else tensor._version


def int8_rows_product(x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) bfloat16 times int8 `rows` (N, K), each scaled by `scales` (N,): ATen's CPU kernel for it."""
    return torch._weight_int8pack_mm(x, rows, scales)


def cxx11_abi() -> int:
    """The C++ ABI this torch was built with (1: the C++11 one), for a library built against it."""
    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


def attention_implementation(config) -> str | None:
    """The attention a transformers model was loaded with ("sdpa", "eager", ...)."""
    return getattr(config, "_attn_implementation", None)


def inductor_cache_default() -> str:
    """Inductor's own cache folder, where the user chose none."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


@contextmanager
def inductor_settings(settings: dict) -> Iterator[None]:
    """Inside this block inductor compiles under `settings` (its configuration's names and values)."""
    from torch._inductor import config

    with config.patch(settings):
        yield


def allow_recompiles(count: int) -> None:
    """Let dynamo compile `count` more graphs of one function in the process before it falls back to eager code."""
    torch._dynamo.config.recompile_limit += count


def mark_dynamic(tensor: torch.Tensor, dim: int, low: int, high: int) -> None:
    """Have `torch.compile` trace `tensor`'s dimension `dim` as a size from `low` to `high`, one graph for all."""
    torch._dynamo.mark_dynamic(tensor, dim, min=low, max=high)


def compile_package(exported, path: str, settings: dict) -> str:
    """An exported program compiled ahead of time (AOTInductor) into a package at `path`, under inductor's
    `settings`."""
    return torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=dict(settings))


def load_package(path: str):
    """An AOTInductor package, loaded (its `loader` takes constants; called as the exported function)."""
    return torch._inductor.aoti_load_package(path)


@contextmanager
def recorded() -> Iterator[dict[str, torch.Tensor]]:
    """Inside this block, every constant that inductor allocates for an ahead-of-time graph, by the name the package
    gives it (its loader keys constants by these names: names it reports can be shared by several constants)."""
    from torch._inductor.graph import GraphLowering

    made, allocate = {}, GraphLowering.allocate_non_dup_const_name

    def recording(graph, name, data):
        allocated = allocate(graph, name, data)
        if graph.aot_mode:
            made[allocated] = data
        return allocated

    GraphLowering.allocate_non_dup_const_name = recording
    try:
        yield made
    finally:
        GraphLowering.allocate_non_dup_const_name = allocate


def cpu_pass_settings(templates: bool) -> dict:
    """Inductor's settings for the CPU pass (`templates`: the products as its C++ GEMM templates alone, see
    `mtp.decoding.compiled.CompiledPass`), with inductor patched for the pass (for the process) on a torch of
    `TORCH`: elsewhere, or where a patch fails, one line says what is skipped and what speed that costs."""
    settings = {
        "max_autotune": templates,
        "max_autotune_gemm_backends": "CPP",
        "autotune_num_choices_displayed": 0,
        "max_autotune_report_choices_stats": False,
        "fx_graph_cache": False,
        "aot_inductor.package_constants_in_so": False,
    }
    # (no table nor line per product on stderr; no graph from inductor's cache, whose key holds no template text:
    # it could give back kernels made before `_accumulators_in_registers`)
    if ".".join(torch.__version__.split(".")[:2]) not in TORCH:
        _say(
            f"mtp: inductor's patches are written for torch {', '.join(TORCH)}, not {torch.__version__}: skipped "
            "(compiled passes of 4 and 8 nodes cost up to 1.5x more on an AVX2 CPU, compiling takes longer)"
        )
        settings.pop("max_autotune_report_choices_stats")  # (a name that newer torches may not have)
        return settings
    patches = {  # each patch: what skipping it costs
        _unpacked_linears: "linear weights packed for oneDNN, not multiplied by the GEMM templates",
        _templates_parsed_once: "compiling takes longer",
        _accumulators_in_registers: "passes of 4 and 8 nodes up to 1.5x slower",
        _eight_rows_at_once: "8-node passes up to 1.4x slower on AVX2",
    }
    for patch, cost in patches.items():
        try:
            patch()
        except Exception as error:  # (inductor's code moved under this torch)
            _say(f"mtp: {patch.__name__.strip('_')} skipped ({type(error).__name__}: {str(error)[:120]}): {cost}")
    try:
        settings |= _vector_isa()
    except Exception as error:
        _say(f"mtp: vector instructions not kept per machine ({type(error).__name__}): each process checks them again")
    return settings


@cache
def _say(line: str) -> None:
    """`line` on stderr, once per process."""
    print(line, file=sys.stderr)


def _unpacked_linears() -> None:
    """Keep the linear products as matrix products when freezing (no weight packed for MKL), for the process: they
    reach inductor as products of frozen weights, which it lowers to its C++ GEMM templates, and no weight becomes a
    oneDNN tensor (which inductor's FX graph cache could not save, when `torch.compile` compiled the CPU's pass).
    (Inductor registers its freezing passes once per process, here without the packing; a pass compiled before in
    the process keeps it.)"""
    from torch._inductor import config
    from torch._inductor.fx_passes.freezing_patterns import lazy_init

    with config.patch({"cpp.weight_prepack": False}):
        lazy_init()


def _templates_parsed_once() -> None:
    """Let inductor parse each of its C++ kernel templates once in the process, not once per product rendered: it
    parses the same few Jinja sources again for each of the 211 products of SmolLM2's pass, twice (about a fifth of a
    package's compile time). A parsed template renders any options."""
    from torch._inductor.codegen.common import KernelTemplate

    parse = KernelTemplate._template_from_string
    if not hasattr(parse, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(cache(parse))


# inductor's C++ micro-kernel for products accumulated in float (`CppMicroGemmFP32Vec`), its common case (B not
# transposed, no tail along N): the accumulators, B's vectors and A's broadcast element as plain loops over arrays,
# and B's row 48 steps ahead fetched into the cache
_MICRO_KERNEL = r"""
{%- if not trans_b and not tail_n and compute_t == "float"
      and input2_dtype in [torch.float, torch.bfloat16, torch.half] %}
    constexpr auto VLEN = Vectorized::size();
    constexpr int ROWS = BLOCK_M;
    constexpr int COLS = BLOCK_N / VLEN;
    Vectorized vc[ROWS * COLS];
    #pragma GCC unroll 64
    for (int i = 0; i < ROWS * COLS; i++) {
        if constexpr (accum) {
            vc[i] = Vectorized::loadu(C + (i / COLS) * ldc + (i % COLS) * VLEN);
        } else {
            vc[i] = Vectorized(0.0f);
        }
    }
    for (int64_t k = 0; k < K; ++k) {
    #if defined(__GNUC__)
        #pragma GCC unroll 8
        for (int i = 0; i < BLOCK_N; i += 64 / sizeof(*B)) {  // every cache line of B's row 48 steps ahead
            __builtin_prefetch(B + (k + 48) * ldb + i, 0, 3);
        }
    #endif
        Vectorized vb[COLS];
        #pragma GCC unroll 16
        for (int c = 0; c < COLS; c++) {
    {%- if input2_dtype == torch.float %}
            vb[c] = Vectorized::loadu(B + k * ldb + c * VLEN);
    {%- else %}
            at::vec::load_to_float(B + k * ldb + c * VLEN, vb[c]);
    {%- endif %}
        }
        #pragma GCC unroll 16
        for (int r = 0; r < ROWS; r++) {
            Vectorized va(static_cast<float>(A[r * lda + k]){% if alpha != 1 %} * {{alpha}}{% endif %});
            #pragma GCC unroll 16
            for (int c = 0; c < COLS; c++) {
                vc[r * COLS + c] = at::vec::fmadd(va, vb[c], vc[r * COLS + c]);
            }
        }
    }
    #pragma GCC unroll 64
    for (int i = 0; i < ROWS * COLS; i++) {
        vc[i].store(C + (i / COLS) * ldc + (i % COLS) * VLEN);
    }
{%- elif not trans_b %}
    constexpr auto VLEN"""


def _accumulators_in_registers() -> None:
    """Inductor's C++ micro-kernel for products accumulated in float, in its common case, as plain loops (above), for
    the process. GCC 12 compiles the template's form (generic lambdas unrolled over arrays of vectors) into a store of
    every accumulator to the stack at each step along K, 24 stores for the 24 multiply-adds of an 8-row block: that held
    the C++ templates to well under MKL's speed. As loops GCC keeps the accumulators in registers (what that bought:
    docs/reference-runs.md). Each step also fetches B's row 48 steps ahead: a block of
    4 rows computes 4 multiply-adds per weight it streams from memory, and without the prefetch the pass over 4 nodes
    costs well over a one-node pass where it should cost about one. Left as it is where this torch's template
    differs."""
    import torch._inductor.lowering  # noqa: F401  (imports inductor's kernels in the order they import each other)
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec as Kernel

    common = "\n{%- if not trans_b %}\n    constexpr auto VLEN"
    if Kernel.TEMPLATE_KERNEL.count(common) == 1:
        Kernel.TEMPLATE_KERNEL = Kernel.TEMPLATE_KERNEL.replace(common, _MICRO_KERNEL)


def _eight_rows_at_once() -> None:
    """On AVX2, a float32 product of 8 rows (or a multiple of 8) takes inductor's micro-kernel of 8 rows by 8 columns,
    for the process. Inductor prefers 4 rows by 24 columns (more accumulators): it multiplies 8 rows as two blocks
    one after the other, the first streaming each block of weights from memory, the second reading it again from the
    cache while memory waits. 8 rows at once read each weight once for all 8 (`benchmarks/compiled_steps.py`
    prints what an 8-node pass costs in one-node passes). Other row counts and
    instruction sets (AVX-512 takes 8 rows a block already) keep inductor's choice."""
    import torch._inductor.lowering  # noqa: F401  (imports inductor's kernels in the order they import each other)
    from torch._inductor.codegen import cpp_micro_gemm as micro
    from torch._inductor.cpu_vec_isa import VecAVX2

    configs = micro.micro_gemm_configs.get(micro.CppMicroGemmFP32Vec, [])
    for index, config in enumerate(configs):
        if (
            config.vec_isa_cls is VecAVX2
            and config.input_dtype == config.input2_dtype == torch.float
            and config.register_blocking.block_m == 4
            and config.extra_check is None
        ):
            configs[index] = dataclasses.replace(config, extra_check=_not_eight_rows)


def _not_eight_rows(config, m: int, *args, **kwargs) -> bool:
    """A micro-kernel configuration's check: not for a product of a multiple of 8 rows."""
    return m % 8 != 0


def _vector_isa() -> dict:
    """Inductor's setting for the CPU's vector instructions. Inductor checks every instruction set the CPU reports
    by compiling a program and loading it in a child Python, in every process (tens of seconds); mtp
    lets it check once per machine and torch version (kept in `$MTP_CACHE/vector_isa.json`), and later trusts what
    the CPU reports while that names the same instruction set. {} where the user set `cpp.vec_isa_ok`."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list

    if config.cpp.vec_isa_ok is not None:
        return {}
    key = f"{device_name('cpu')}, torch {torch.__version__}"
    checked = measured("vector_isa.json", key, lambda: str(pick_vec_isa()))
    valid_vec_isa_list.cache_clear()  # computed again under the setting that applies
    with config.patch({"cpp.vec_isa_ok": True}):
        trusted = str(pick_vec_isa()) == checked
    valid_vec_isa_list.cache_clear()
    return {"cpp.vec_isa_ok": True} if trusted else {}
