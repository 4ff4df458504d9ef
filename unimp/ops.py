"""The canonical op vocabulary and its native names in each framework — data, not code.

A canonical op is a framework-neutral class of operations. Backends look up the native names
they control here; nothing in this module imports a framework.

>>> OPS["matmul"].meaning
'matrix products (mm, bmm, einsum, @)'
>>> "linear" in CANONICAL_OPS
True
>>> suggest("matmull", CANONICAL_OPS)
'matmul'
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OpInfo:
    """One canonical op: what it means and what it covers in each framework."""

    name: str
    meaning: str
    torch: tuple[str, ...] = ()  # aten op names (as in torch's autocast lists)
    paddle: tuple[str, ...] = ()  # paddle op types (as in paddle.amp white/black lists)
    tensorflow: tuple[str, ...] = ()  # TF graph ops (grappler AMP lists)
    keras: tuple[str, ...] = ()  # Keras 3 layer classes
    flax: tuple[str, ...] = ()  # flax.linen / flax.nnx module classes
    extra: dict = field(default_factory=dict)


def _t(*names: str) -> tuple[str, ...]:
    return tuple(names)


# Sources of the native names below:
#  torch:  docs/source/amp.rst ("CUDA Ops that can autocast to float16", "... to float32",
#          "CPU Ops that can autocast to bfloat16", ...) and aten/src/ATen/autocast_mode.cpp
#  paddle: python/paddle/amp/amp_lists.py (WHITE_LIST, FP16_BLACK_LIST, BF16 lists) and
#          python/paddle/static/amp/bf16/amp_lists.py
#  tensorflow: tensorflow/core/grappler/optimizers/auto_mixed_precision_lists.h (Allow/Deny/Infer/Clear)
#  keras / flax: the layer classes of keras.layers, flax.linen and flax.nnx
_OPS: tuple[OpInfo, ...] = (
    OpInfo(
        "matmul", "matrix products (mm, bmm, einsum, @)",
        torch=_t("matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv",
                 "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "__matmul__"),
        paddle=_t("matmul", "matmul_v2", "mul", "einsum", "bmm", "fused_gemm_epilogue"),
        tensorflow=_t("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"),
        keras=_t("EinsumDense"), flax=_t("Einsum"),
    ),
    OpInfo(
        "linear", "fully connected layers (x @ W + b)",
        torch=_t("linear", "Linear"), paddle=_t("linear", "Linear"),
        tensorflow=_t("MatMul"), keras=_t("Dense"),
        flax=_t("Dense", "DenseGeneral", "Linear", "LinearGeneral"),
    ),
    OpInfo(
        "conv", "convolutions and transposed convolutions",
        torch=_t("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                 "conv_transpose3d", "_convolution", "conv_tbc", "Conv1d", "Conv2d", "Conv3d",
                 "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"),
        paddle=_t("conv2d", "conv3d", "conv2d_transpose", "depthwise_conv2d", "Conv1D", "Conv2D",
                  "Conv3D", "Conv2DTranspose"),
        tensorflow=_t("Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput", "Conv3D",
                      "DepthwiseConv2dNative"),
        keras=_t("Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
                 "Conv3DTranspose", "DepthwiseConv2D", "SeparableConv2D"),
        flax=_t("Conv", "ConvTranspose", "ConvLocal"),
    ),
    OpInfo(
        "attention", "scaled dot-product / multi-head attention",
        torch=_t("scaled_dot_product_attention", "_native_multi_head_attention", "MultiheadAttention"),
        paddle=_t("flash_attn", "scaled_dot_product_attention", "MultiHeadAttention"),
        tensorflow=_t(), keras=_t("MultiHeadAttention", "Attention", "GroupedQueryAttention"),
        flax=_t("MultiHeadAttention", "MultiHeadDotProductAttention", "SelfAttention"),
    ),
    OpInfo(
        "rnn", "recurrent cells and layers",
        torch=_t("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "mkldnn_rnn_layer",
                 "LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell"),
        paddle=_t("rnn", "lstm", "LSTM", "GRU", "SimpleRNN"),
        tensorflow=_t("BlockLSTM", "BlockLSTMV2", "CudnnRNN", "CudnnRNNV3", "GRUBlockCell", "LSTMBlockCell"),
        keras=_t("LSTM", "GRU", "SimpleRNN", "LSTMCell", "GRUCell"),
        flax=_t("LSTMCell", "GRUCell", "OptimizedLSTMCell", "RNN"),
    ),
    OpInfo(
        "embedding", "table lookups",
        torch=_t("embedding", "embedding_bag", "Embedding", "EmbeddingBag"),
        paddle=_t("lookup_table_v2", "embedding", "Embedding"),
        tensorflow=_t("ResourceGather", "GatherV2"), keras=_t("Embedding"), flax=_t("Embed"),
    ),
    OpInfo(
        "softmax", "softmax and softmin",
        torch=_t("softmax", "softmin", "_softmax", "Softmax", "Softmin"),
        paddle=_t("softmax", "Softmax"), tensorflow=_t("Softmax"), keras=_t("Softmax"),
        flax=_t("softmax"),
    ),
    OpInfo(
        "log_softmax", "log of softmax",
        torch=_t("log_softmax", "_log_softmax", "LogSoftmax"),
        paddle=_t("log_softmax", "LogSoftmax"), tensorflow=_t("LogSoftmax"), keras=_t(),
        flax=_t("log_softmax"),
    ),
    OpInfo(
        "layer_norm", "layer normalisation",
        torch=_t("layer_norm", "native_layer_norm", "LayerNorm"),
        paddle=_t("layer_norm", "LayerNorm"), tensorflow=_t(), keras=_t("LayerNormalization"),
        flax=_t("LayerNorm"),
    ),
    OpInfo(
        "rms_norm", "RMS normalisation",
        torch=_t("rms_norm", "RMSNorm"), paddle=_t("rms_norm", "RMSNorm"), tensorflow=_t(),
        keras=_t("RMSNormalization"), flax=_t("RMSNorm"),
    ),
    OpInfo(
        "batch_norm", "batch normalisation (in `float32`: fp32 params, statistics and math; the output "
                      "keeps the activation dtype, as torch and Keras run it)",
        torch=_t("batch_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"),
        paddle=_t("batch_norm", "sync_batch_norm", "BatchNorm", "BatchNorm1D", "BatchNorm2D", "BatchNorm3D"),
        tensorflow=_t("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
        keras=_t("BatchNormalization"), flax=_t("BatchNorm"),
    ),
    OpInfo(
        "group_norm", "group / instance normalisation",
        torch=_t("group_norm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d"),
        paddle=_t("group_norm", "instance_norm", "GroupNorm", "InstanceNorm2D"),
        tensorflow=_t(), keras=_t("GroupNormalization"), flax=_t("GroupNorm", "InstanceNorm"),
    ),
    OpInfo(
        "activation", "pointwise activations (relu, gelu, silu, tanh, sigmoid, prelu)",
        torch=_t("relu", "gelu", "silu", "tanh", "sigmoid", "prelu", "leaky_relu", "elu", "ReLU",
                 "GELU", "SiLU", "Tanh", "Sigmoid", "PReLU", "LeakyReLU", "ELU"),
        paddle=_t("relu", "gelu", "silu", "tanh", "sigmoid", "ReLU", "GELU", "Silu", "Tanh", "Sigmoid"),
        tensorflow=_t("Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Tanh", "LeakyRelu"),
        keras=_t("Activation", "ReLU", "ELU", "LeakyReLU", "PReLU"),
        flax=_t("relu", "gelu", "silu", "tanh", "sigmoid"),
    ),
    OpInfo(
        "transcendental", "exp, log, pow, rsqrt, trigonometric and friends",
        torch=_t("exp", "expm1", "log", "log10", "log1p", "log2", "pow", "__pow__", "__rpow__",
                 "rsqrt", "reciprocal", "__rdiv__", "__rtruediv__", "acos", "asin", "cosh", "sinh",
                 "tan", "erfinv", "softplus"),
        paddle=_t("exp", "expm1", "log", "log10", "log2", "pow", "rsqrt", "reciprocal", "square",
                  "acos", "asin", "sinh", "cosh", "atanh", "tan", "erfinv", "softplus"),
        tensorflow=_t("Exp", "Expm1", "Log", "Log1p", "Pow", "Rsqrt", "Reciprocal"),
        keras=_t(), flax=_t("exp", "log", "power", "rsqrt"),
    ),
    OpInfo(
        "reduction", "sums, means, cumulative ops and norms (windowed pooling follows its inputs)",
        torch=_t("sum", "mean", "prod", "cumsum", "cumprod", "norm", "normalize", "dist", "cdist", "pdist",
                 "renorm", "cosine_similarity"),
        paddle=_t("reduce_sum", "sum", "mean", "reduce_mean", "reduce_prod", "cumsum", "cumprod",
                  "p_norm", "frobenius_norm", "dist", "renorm"),
        tensorflow=_t("Sum", "Mean", "Prod", "Cumsum"), keras=_t(), flax=_t("sum", "mean"),
    ),
    OpInfo(
        "loss", "loss functions",
        torch=_t("cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss2d", "mse_loss",
                 "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
                 "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss",
                 "hinge_embedding_loss", "margin_ranking_loss", "multilabel_margin_loss",
                 "multi_margin_loss", "soft_margin_loss", "triplet_margin_loss", "ctc_loss"),
        paddle=_t("softmax_with_cross_entropy", "cross_entropy", "cross_entropy2",
                  "sigmoid_cross_entropy_with_logits", "nll_loss", "huber_loss", "log_loss",
                  "margin_cross_entropy", "c_softmax_with_cross_entropy", "mse_loss"),
        tensorflow=_t("SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits", "L2Loss"),
        keras=_t(), flax=_t(),
    ),
    OpInfo(
        "elementwise", "binary pointwise arithmetic (add, mul, addcmul, atan2, ...)",
        torch=_t("add", "sub", "mul", "div", "addcdiv", "addcmul", "atan2", "cross", "bilinear",
                 "dot", "tensordot", "grid_sampler", "index_put", "scatter_add"),
        paddle=_t("elementwise_add", "elementwise_sub", "elementwise_mul", "elementwise_div"),
        tensorflow=_t("Add", "AddV2", "AddN", "Sub", "Mul", "BiasAdd"),
        keras=_t("Add", "Subtract", "Multiply", "Average"), flax=_t(),
    ),
    OpInfo(
        "concat", "concatenation and stacking",
        torch=_t("cat", "stack", "index_copy"), paddle=_t("concat", "stack"),
        tensorflow=_t("Concat", "ConcatV2", "Pack"), keras=_t("Concatenate"), flax=_t(),
    ),
)

OPS: dict[str, OpInfo] = {op.name: op for op in _OPS}
CANONICAL_OPS: tuple[str, ...] = tuple(OPS)
OP_LISTS = ("lower", "float32", "promote")


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest valid name to a misspelt one, or None."""
    found = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


NativeTable = Mapping[str, tuple[str, ...]]  # canonical op -> a framework's native names for it


def native_table(backend: str, names: Mapping[str, Iterable[str]]) -> dict[str, tuple[str, ...]]:
    """Check a backend's native op-name table (canonical op -> native names) and freeze it.

    >>> native_table("demo", {"matmul": ["MatMul"]})["matmul"]
    ('MatMul',)
    """
    bad = [op for op in names if op not in OPS]
    if bad:
        hints = [f"{op!r}" + (f" (did you mean {s!r}?)" if (s := suggest(op, CANONICAL_OPS)) else "") for op in bad]
        raise ValueError(f"backend {backend}: native op table names unknown canonical ops: {', '.join(hints)}; "
                         f"the canonical ops are: {', '.join(CANONICAL_OPS)}")
    return {op: tuple(names.get(op, ())) for op in CANONICAL_OPS}


def kind_of(native_name: str, table: NativeTable | str) -> str | None:
    """The canonical op ``native_name`` belongs to in a backend's native table (first match).

    >>> kind_of("Dense", {"linear": ("Dense",)})
    'linear'
    """
    if isinstance(table, str):  # a framework column of the legacy OPS table
        return next((op.name for op in _OPS if native_name in getattr(op, table)), None)
    return next((op for op, names in table.items() if native_name in names), None)


def class_names(cls: type, stop: Iterable[type] = ()) -> tuple[str, ...]:
    """``cls`` and its bases, most specific first, up to the first class in ``stop`` (or ``object``).

    >>> class Base: ...
    >>> class Mine(Base): ...
    >>> class_names(Mine)
    ('Mine', 'Base')
    """
    ends = (*tuple(stop), object)
    out = []
    for c in cls.__mro__:
        if c in ends:
            break
        out.append(c.__name__)
    return tuple(out)


def kind_of_names(names: Iterable[str], table: NativeTable) -> str | None:
    """The canonical op of the first name (most specific class first) the table knows: the
    class -> op walk every backend shares (a subclass of ``Dense`` is a ``linear``).

    >>> kind_of_names(("MyDense", "Dense"), {"linear": ("Dense",)})
    'linear'
    """
    for name in names:
        k = kind_of(name, table)
        if k:
            return k
    return None
