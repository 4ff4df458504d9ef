"""The native names of each canonical op: Keras layer classes (``KerasBackend.native_ops``) and, for reference, the
TF graph ops of grappler's AMP lists (tensorflow/core/grappler/optimizers/auto_mixed_precision_lists.h).

>>> NATIVE_OPS["linear"]
('Dense',)
"""

from __future__ import annotations

NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("EinsumDense",),
    "linear": ("Dense",),
    "conv": ("Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
        "DepthwiseConv2D", "SeparableConv2D"),
    "attention": ("MultiHeadAttention", "Attention", "GroupedQueryAttention"),
    "rnn": ("LSTM", "GRU", "SimpleRNN", "LSTMCell", "GRUCell"),
    "embedding": ("Embedding",),
    "softmax": ("Softmax",),
    "layer_norm": ("LayerNormalization",),
    "rms_norm": ("RMSNormalization",),
    "batch_norm": ("BatchNormalization",),
    "group_norm": ("GroupNormalization",),
    "activation": ("Activation", "ReLU", "ELU", "LeakyReLU", "PReLU"),
    "elementwise": ("Add", "Subtract", "Multiply", "Average"),
    "concat": ("Concatenate",),
}

# TF graph ops (grappler AMP Allow/Deny/Infer/Clear lists) per canonical op
GRAPH_OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"),
    "linear": ("MatMul",),
    "conv": ("Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput", "Conv3D", "DepthwiseConv2dNative"),
    "rnn": ("BlockLSTM", "BlockLSTMV2", "CudnnRNN", "CudnnRNNV3", "GRUBlockCell", "LSTMBlockCell"),
    "embedding": ("ResourceGather", "GatherV2"),
    "softmax": ("Softmax",),
    "log_softmax": ("LogSoftmax",),
    "batch_norm": ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
    "activation": ("Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Tanh", "LeakyRelu"),
    "transcendental": ("Exp", "Expm1", "Log", "Log1p", "Pow", "Rsqrt", "Reciprocal"),
    "reduction": ("Sum", "Mean", "Prod", "Cumsum"),
    "loss": ("SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits", "L2Loss"),
    "elementwise": ("Add", "AddV2", "AddN", "Sub", "Mul", "BiasAdd"),
    "concat": ("Concat", "ConcatV2", "Pack"),
}
