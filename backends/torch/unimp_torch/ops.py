"""The native names of torch for each canonical op: aten op names (as in torch's autocast lists) and ``torch.nn`` module
classes. The backend declares this table (``TorchBackend.native_ops``); the core reads no framework's names.

Source: torch's docs/source/amp.rst ("CUDA Ops that can autocast to float16", "... to float32", "CPU Ops that can
autocast to bfloat16", ...) and aten/src/ATen/autocast_mode.cpp.

>>> NATIVE_OPS["linear"]
('linear', 'Linear')
"""

from __future__ import annotations

NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "chain_matmul",
        "linalg_multi_dot", "linalg_vecdot", "__matmul__"),
    "linear": ("linear", "Linear"),
    "conv": ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "_convolution", "conv_tbc", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
        "ConvTranspose3d"),
    "attention": ("scaled_dot_product_attention", "_native_multi_head_attention", "MultiheadAttention"),
    "rnn": ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "mkldnn_rnn_layer", "LSTM", "GRU", "RNN",
        "LSTMCell", "GRUCell", "RNNCell"),
    "embedding": ("embedding", "embedding_bag", "Embedding", "EmbeddingBag"),
    "softmax": ("softmax", "softmin", "_softmax", "Softmax", "Softmin"),
    "log_softmax": ("log_softmax", "_log_softmax", "LogSoftmax"),
    "layer_norm": ("layer_norm", "native_layer_norm", "LayerNorm"),
    "rms_norm": ("rms_norm", "RMSNorm"),
    "batch_norm": ("batch_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"),
    "group_norm": ("group_norm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d"),
    "activation": ("relu", "gelu", "silu", "tanh", "sigmoid", "prelu", "leaky_relu", "elu", "ReLU", "GELU",
        "SiLU", "Tanh", "Sigmoid", "PReLU", "LeakyReLU", "ELU"),
    "transcendental": ("exp", "expm1", "log", "log10", "log1p", "log2", "pow", "__pow__", "__rpow__", "rsqrt",
        "reciprocal", "__rdiv__", "__rtruediv__", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softplus"),
    "reduction": ("sum", "mean", "prod", "cumsum", "cumprod", "norm", "normalize", "dist", "cdist", "pdist",
        "renorm", "cosine_similarity"),
    "loss": ("cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss2d", "mse_loss", "l1_loss",
        "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits",
        "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "multi_margin_loss", "soft_margin_loss", "triplet_margin_loss", "ctc_loss"),
    "elementwise": ("add", "sub", "mul", "div", "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot",
        "tensordot", "grid_sampler", "index_put", "scatter_add"),
    "concat": ("cat", "stack", "index_copy"),
}
