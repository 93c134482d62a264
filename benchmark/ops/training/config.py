"""Real model shapes for the training-op benchmarks.

Numbers follow the published Hugging Face ``config.json`` of each model. GEMMs use the Linear
layout: activations are (M, K) with M = micro-batch size * sequence length, weights are (N, K).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEEPSEEK_V3",
    "DEFAULT_SEQ_LEN",
    "DENSE_MODELS",
    "MOE_MODELS",
    "SHAPE_SETS",
    "DenseModelConfig",
    "GemmShape",
    "MLAModelConfig",
    "MoEModelConfig",
    "deepseek_v3_gemm_shapes",
    "dense_gemm_shapes",
    "gemm_shape_set",
]

DEFAULT_SEQ_LEN = 4096
SHAPE_SETS = ("full", "quick", "lowp", "tiny")


@dataclass(frozen=True)
class DenseModelConfig:
    """Attention + dense (SwiGLU) FFN dimensions of a decoder-only transformer."""

    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class MLAModelConfig:
    """Multi-head latent attention (DeepSeek-V2/V3) + dense FFN dimensions."""

    name: str
    hidden: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class MoEModelConfig:
    """Routed-expert dimensions, for grouped-GEMM benchmarks."""

    name: str
    num_experts: int
    moe_intermediate: int
    hidden: int
    topk: int


@dataclass(frozen=True)
class GemmShape:
    """One benchmark GEMM: out (M, N) = a (M, K) @ w (N, K)^T."""

    model: str
    gemm: str
    mbs: int
    M: int
    N: int
    K: int


DENSE_MODELS: dict[str, DenseModelConfig] = {
    m.name: m
    for m in (
        DenseModelConfig("Llama-3-8B", 4096, 32, 8, 128, 14336, 128256),
        DenseModelConfig("Llama-3-70B", 8192, 64, 8, 128, 28672, 128256),
        DenseModelConfig("Llama-3.1-405B", 16384, 128, 8, 128, 53248, 128256),
        DenseModelConfig("Qwen2.5-7B", 3584, 28, 4, 128, 18944, 152064),
        DenseModelConfig("Qwen2.5-72B", 8192, 64, 8, 128, 29568, 152064),
        # Attention plus one expert FFN, benchmarked as dense GEMMs.
        DenseModelConfig("Mixtral-8x7B", 4096, 32, 8, 128, 14336, 32000),
    )
}

DEEPSEEK_V3 = MLAModelConfig(
    name="DeepSeek-V3",
    hidden=7168,
    num_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate=18432,  # dense FFN of the first three layers
    vocab=129280,
)

MOE_MODELS: dict[str, MoEModelConfig] = {
    m.name: m
    for m in (
        MoEModelConfig("DeepSeek-V3", 256, 2048, 7168, 8),
        MoEModelConfig("Mixtral-8x7B", 8, 14336, 4096, 2),
        MoEModelConfig("Qwen3-30B-A3B", 128, 768, 2048, 8),
        MoEModelConfig("Qwen3-235B-A22B", 128, 1536, 4096, 8),
    )
}


def _shapes(
    model: str, gemms: list[tuple[str, int, int]], seq_len: int, mbs_list: tuple[int, ...]
) -> list[GemmShape]:
    return [GemmShape(model, gemm, mbs, mbs * seq_len, n, k) for mbs in mbs_list for gemm, n, k in gemms]


def dense_gemm_shapes(
    model: DenseModelConfig, seq_len: int = DEFAULT_SEQ_LEN, mbs_list: tuple[int, ...] = (1, 2)
) -> list[GemmShape]:
    """QKV, attn-out, gate+up, down and lm_head GEMMs of ``model`` for each micro-batch size."""
    gemms = [
        ("QKV", (model.num_heads + 2 * model.num_kv_heads) * model.head_dim, model.hidden),
        ("attn-out", model.hidden, model.num_heads * model.head_dim),
        ("gate+up", 2 * model.intermediate, model.hidden),
        ("down", model.hidden, model.intermediate),
        ("lm_head", model.vocab, model.hidden),
    ]
    return _shapes(model.name, gemms, seq_len, mbs_list)


def deepseek_v3_gemm_shapes(
    seq_len: int = DEFAULT_SEQ_LEN, mbs_list: tuple[int, ...] = (1, 2)
) -> list[GemmShape]:
    """MLA projections, dense FFN and lm_head GEMMs of DeepSeek-V3 for each micro-batch size."""
    m = DEEPSEEK_V3
    gemms = [
        ("q_down", m.q_lora_rank, m.hidden),
        ("q_up", m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank),
        ("kv_down", m.kv_lora_rank + m.qk_rope_head_dim, m.hidden),
        ("kv_up", m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        ("attn-out", m.hidden, m.num_heads * m.v_head_dim),
        ("gate+up", 2 * m.intermediate, m.hidden),
        ("down", m.hidden, m.intermediate),
        ("lm_head", m.vocab, m.hidden),
    ]
    return _shapes(m.name, gemms, seq_len, mbs_list)


def gemm_shape_set(name: str) -> list[GemmShape]:
    """Shapes of a named set, deduplicated on (M, N, K) keeping the first label.

    ``full``: every model above at mbs 1 and 2; ``quick``: Llama-3-8B and DeepSeek-V3 at mbs 1;
    ``lowp``: the shapes the FP8 targets name (8192^3, Llama-3-70B's MLP) followed by ``quick``;
    ``tiny``: one small shape for CPU smoke tests.
    """
    if name == "full":
        shapes = [s for model in DENSE_MODELS.values() for s in dense_gemm_shapes(model)]
        shapes += deepseek_v3_gemm_shapes()
    elif name == "quick":
        shapes = dense_gemm_shapes(DENSE_MODELS["Llama-3-8B"], mbs_list=(1,))
        shapes += deepseek_v3_gemm_shapes(mbs_list=(1,))
    elif name == "lowp":
        llama70b = dense_gemm_shapes(DENSE_MODELS["Llama-3-70B"], mbs_list=(1,))
        shapes = [GemmShape("square", "8192^3", 1, 8192, 8192, 8192)]
        shapes += [s for s in llama70b if s.gemm in ("gate+up", "down")]
        shapes += gemm_shape_set("quick")
    elif name == "tiny":
        shapes = [GemmShape("tiny", "tiny", 1, 64, 64, 128)]
    else:
        raise ValueError(f"unknown shape set {name!r}; choose from {SHAPE_SETS}")
    unique: dict[tuple[int, int, int], GemmShape] = {}
    for shape in shapes:
        unique.setdefault((shape.M, shape.N, shape.K), shape)
    return list(unique.values())


@dataclass(frozen=True)
class TPShape:
    """One tensor-parallel GEMM and its collective: out (M, N) = a (M, K) @ w (K, N), with M the tokens of
    the whole group and N (column-parallel, after an all-gather) or K (row-parallel, before a
    reduce-scatter) already this rank's share."""

    model: str
    gemm: str
    kind: str  # "all-gather" or "reduce-scatter"
    M: int
    N: int
    K: int


ASYNC_TP_SHAPE_SETS = ("llama70b", "tiny")


def async_tp_shapes(name: str, tp: int) -> list[TPShape]:
    """``llama70b``: Llama-3-70B's QKV, up and gate+up (all-gather + GEMM) and attn-out and down
    (GEMM + reduce-scatter) at 4096, 8192 and 16384 tokens; ``tiny``: one of each for CPU smoke runs."""
    if name == "tiny":
        return [TPShape("tiny", "fc1", "all-gather", 64, 96 // tp, 64),
                TPShape("tiny", "fc2", "reduce-scatter", 64, 64, 96 // tp)]  # fmt: skip
    if name != "llama70b":
        raise ValueError(f"unknown async-TP shape set {name!r}; choose from {ASYNC_TP_SHAPE_SETS}")
    m = DENSE_MODELS["Llama-3-70B"]
    column = [
        ("QKV", (m.num_heads + 2 * m.num_kv_heads) * m.head_dim),
        ("up", m.intermediate),
        ("gate+up", 2 * m.intermediate),
    ]
    row = [("attn-out", m.num_heads * m.head_dim), ("down", m.intermediate)]
    shapes = []
    for tokens in (4096, 8192, 16384):
        shapes += [TPShape(m.name, g, "all-gather", tokens, n // tp, m.hidden) for g, n in column]
        shapes += [TPShape(m.name, g, "reduce-scatter", tokens, m.hidden, k // tp) for g, k in row]
    return shapes
