"""Code no command reaches yet, kept with its tests and benchmarks: the training BatchNorm op
(``training_batch_norm``, CUDA forward/backward behind ``torch.autograd``). Its interface may change."""
