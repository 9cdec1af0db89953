"""Model factories for the CLI tests (``--factory model_zoo:NAME``).

torchvision and timm models are built with random weights (nothing can be downloaded); the
tests save state_dicts of instances whose BatchNorm statistics were randomised.
"""

from pathlib import Path

import torch
import torchvision
from torch import nn

from deploykit.testing import calibrate_batch_norm, randomize_batch_norm


def resnet18() -> nn.Module:
    return torchvision.models.resnet18(num_classes=17)


def resnet18_sync_batch_norm() -> nn.Module:
    """What a DDP training script holds: SyncBatchNorm layers, which we must turn into BN."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(resnet18())


def mobilenet_v3_small() -> nn.Module:
    return torchvision.models.mobilenet_v3_small(num_classes=17)


def densenet121() -> nn.Module:
    """BatchNorms after concatenations, which no weight can absorb."""
    return torchvision.models.densenet121(num_classes=17)


def _timm(name: str) -> nn.Module:
    import timm  # a test extra; imported here so that the other factories need none of it

    return timm.create_model(name, num_classes=17)


def resnetv2_18() -> nn.Module:
    """timm's pre-activation ResNet: BatchNorm -> ReLU before each conv, which no weight absorbs."""
    return _timm("resnetv2_18")


def repvgg_a0() -> nn.Module:
    """timm's RepVGG in its training form: 3x3, 1x1 and identity-BatchNorm branches summed."""
    return _timm("repvgg_a0")


def efficientnet_b0() -> nn.Module:
    """timm's EfficientNet: depthwise convs, squeeze-excitation, SiLU. With random BatchNorm
    statistics its outputs reach ~1e3 and fp32 rounding alone exceeds the fp32 tolerance."""
    return _timm("efficientnet_b0")


class Cancelling(nn.Module):
    """Two products with weights of 1e4 that cancel to outputs of a few units: fp32 keeps errors
    of a few 1e-2 there, far above the fp32 tolerance, in PyTorch and any other runtime alike.
    The tanh in front makes runtimes differ: on some CPUs ONNX Runtime's MatMul rounds exactly as
    PyTorch's does, but its tanh differs from PyTorch's in the last bit, which the weights amplify."""

    def __init__(self, width: int = 64, outputs: int = 8):
        super().__init__()
        weight = torch.linspace(-1.0, 1.0, width * outputs).reshape(width, outputs) * 1e4
        self.weight = nn.Parameter(weight)
        self.weight2 = nn.Parameter(-weight * (1 - 1e-4))

    def forward(self, x):
        hidden = torch.tanh(x)
        return hidden @ self.weight + hidden @ self.weight2


def cancelling() -> nn.Module:
    return Cancelling()


class Decoder(nn.Module):
    """ConvTranspose -> BN upsampling (grouped and plain), then a BN -> 1x1 conv head."""

    def __init__(self):
        super().__init__()
        self.up1 = nn.Sequential(nn.ConvTranspose2d(8, 12, 4, stride=2, padding=1), nn.BatchNorm2d(12), nn.ReLU())
        self.up2 = nn.Sequential(nn.ConvTranspose2d(12, 6, 3, stride=2, groups=3, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.head = nn.Sequential(nn.BatchNorm2d(6), nn.Conv2d(6, 5, 1))

    def forward(self, x):
        return self.head(self.up2(self.up1(x)))


def decoder() -> nn.Module:
    return Decoder()


class TabularNet(nn.Module):
    """Linear -> BatchNorm1d blocks, as in tabular and embedding heads; two outputs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(13, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16, bias=False), nn.BatchNorm1d(16))
        self.classes = nn.Linear(16, 4)

    def forward(self, features):
        hidden = self.body(features)
        return self.classes(hidden), hidden


def tabular() -> nn.Module:
    return TabularNet()


class TinyConv(nn.Module):
    """Conv -> BatchNorm -> ReLU -> Linear on 3x8x8 images: small enough that AOTInductor compiles it quickly."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def tiny_conv() -> nn.Module:
    return TinyConv()


class ResidualConv(nn.Module):
    """A residual block whose BatchNorm follows the Add (pre-activation style: no weight absorbs it,
    deploykit::FusedBatchNorm does), then a Linear -> ReLU head; 3x16x16 images, 10 classes."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                    nn.Conv2d(16, 16, 3, padding=1))
        self.after_add = nn.Sequential(nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        stem = self.stem(x)
        features = self.after_add(stem + self.branch(stem))
        return self.head(nn.functional.adaptive_avg_pool2d(features, 4))


def residual_conv() -> nn.Module:
    return ResidualConv()


class TransformerMLP(nn.Module):
    """Transformer-style feed-forward blocks: Linear -> ReLU -> Linear on (batch, tokens, width)."""

    def __init__(self, width: int = 40, hidden: int = 96, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width), nn.ReLU())
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 7)

    def forward(self, tokens):
        for block in self.blocks:
            tokens = tokens + block(tokens)
        return self.head(tokens)


def transformer_mlp() -> nn.Module:
    return TransformerMLP()


def transformer_mlp_32() -> nn.Module:
    """Widths that are multiples of 16, as fp8 products need (the head's 7 outputs are not)."""
    return TransformerMLP(width=32, hidden=64)


class ImageAndTokens(nn.Module):
    """Two inputs of different dtypes: an image branch (Conv -> BN) and a token embedding."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.tokens = nn.Embedding(8, 8)
        self.head = nn.Linear(16, 5)

    def forward(self, image, ids):
        return self.head(torch.cat([self.image(image), self.tokens(ids).mean(1)], dim=1))


def image_and_tokens() -> nn.Module:
    return ImageAndTokens()


class Block(nn.Module):
    """Pre-norm transformer block: attention and an MLP, each behind a LayerNorm."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class SmallTransformer(nn.Module):
    """Attention + LayerNorm + MLP: the numerically sensitive mix fp16 conversion must survive."""

    def __init__(self, features: int = 12, tokens: int = 16, width: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.position = nn.Parameter(torch.randn(tokens, width) * 0.1)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x) + self.position)).mean(1))


def small_transformer() -> nn.Module:
    return SmallTransformer()


def one_output() -> nn.Module:
    """Takes the tabular net's input but returns one output (a model the bundle was not made from)."""
    return nn.Linear(13, 4)


# --- models that plain fp16 conversion gets wrong (the tests of layer-wise debugging and auto-fix) ---

ACTIVATION_OFFSET = 3000.0  # fp16 spacing at 2048..4096 is 2: a spread of ~0.6 around it rounds away


class LargeActivationNorm(nn.Module):
    """Embeddings around 3000 with a small spread, then LayerNorm and a classifier."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 10)
        with torch.no_grad():
            self.embed.bias.add_(ACTIVATION_OFFSET)

    def forward(self, x):
        return self.head(self.norm(self.embed(x)))


class SumPooling(nn.Module):
    """Sum pooling over 256 tokens: far inside fp16 on N(0, 1) inputs, beyond it at raw scale."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)).sum(dim=1))


def large_activation_norm() -> nn.Module:
    return LargeActivationNorm()


def sum_pooling() -> nn.Module:
    return SumPooling()


# --- a model that plain int8 quantization gets wrong (the test of int8 auto-fix) ---


class OutlierFeature(nn.Module):
    """A hidden layer with one feature 200x larger than the rest (the outlier features of large
    transformers) that the head barely reads: one per-tensor uint8 scale for the hidden activation
    leaves the other features a step or two, and the head's output is mostly quantization noise."""

    def __init__(self):
        super().__init__()
        self.hidden, self.head = nn.Linear(16, 64), nn.Linear(64, 10)
        with torch.no_grad():
            self.hidden.weight[0].mul_(200.0)
            self.hidden.bias[0].add_(200.0)
            self.head.weight[:, 0].mul_(0.001)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(x)))


def outlier_feature() -> nn.Module:
    return OutlierFeature()


class Fp8Outlier(nn.Module):
    """An ordinary layer, then a hidden layer with one feature near 2e4 (its bias) and the others near
    0.03, and a head that barely reads the large one (no bias): one per-tensor e4m3 scale for the head's
    input (448 its largest value, 2^-9 its smallest step) leaves the small features zero or one step, so
    the head alone in fp8 fails (cosine ~0.56) while the other two pass. Widths are fp8's (x16); every
    value fits fp16."""

    def __init__(self):
        super().__init__()
        self.first, self.hidden, self.head = nn.Linear(16, 32), nn.Linear(32, 64), nn.Linear(64, 16)
        with torch.no_grad():
            self.hidden.weight[1:].mul_(0.1)
            self.hidden.bias[1:].mul_(0.1)
            self.hidden.bias[0] = 2e4
            self.head.weight[:, 0].mul_(1e-6)
            self.head.bias.zero_()

    def forward(self, x):
        return self.head(torch.relu(self.hidden(torch.relu(self.first(x)))))


def fp8_outlier() -> nn.Module:
    return Fp8Outlier()


class ResidualStream(nn.Module):
    """A pre-LayerNorm transformer's residual stream without attention: the input scaled up,
    ``blocks`` x (LayerNorm -> MLP, added back), then summed over the tokens.

    The stream carries values of a few hundred to a few thousand, so each fp16 rounding on it (the
    residual Adds, the scaling Mul, the token sum) costs a little and no single node much.
    ``embedded``: a Linear embedding before the scaling (its rounding is scaled up too) and a
    Linear head after the sum (it reads the sum's large values).
    """

    def __init__(self, blocks: int = 4, scale: float = 300.0, embedded: bool = False, width: int = 32):
        super().__init__()
        self.scale = scale
        self.embed = nn.Linear(width, width) if embedded else nn.Identity()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(blocks))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(blocks)
        )
        self.head = nn.Linear(width, 10) if embedded else nn.Identity()

    def forward(self, x):
        x = self.embed(x) * self.scale
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return self.head(x.sum(dim=1))


def residual_stream() -> nn.Module:
    """The issue's case: input x300, four blocks (tokens: the --input shape, 128 in the tests)."""
    return ResidualStream()


def residual_stream_2x30() -> nn.Module:
    return ResidualStream(blocks=2, scale=30.0)


def residual_stream_6x300() -> nn.Module:
    return ResidualStream(blocks=6, scale=300.0)


def embedded_residual_stream_2x300() -> nn.Module:
    return ResidualStream(blocks=2, scale=300.0, embedded=True)


def embedded_residual_stream_4x30() -> nn.Module:
    return ResidualStream(blocks=4, scale=30.0, embedded=True)

# --- weights -------------------------------------------------------------------------------------


#: Models whose random BatchNorm statistics make every input give the same output (mobilenet_v3_small's
#: logits then spread by 7e-8 at 0.06: an inconclusive validation); they get measured statistics.
_MEASURED_STATISTICS = {"mobilenet_v3_small": (3, 67, 53)}


def trained_like(name: str, seed: int) -> nn.Module:
    """The model ``name`` with random BatchNorm statistics, or statistics measured on random inputs
    where random ones would make its output independent of the input."""
    torch.manual_seed(0)
    model = globals()[name]()
    if name not in _MEASURED_STATISTICS:
        return randomize_batch_norm(model, seed=seed)
    images = [torch.randn(8, *_MEASURED_STATISTICS[name], generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return calibrate_batch_norm(model, images, seed=seed)


def save_ddp_state_dict(name: str, path: Path) -> None:
    """Weights of the model ``name`` as ``trained_like`` makes them, saved the way DDP saves them
    (``module.`` prefixes)."""
    model = trained_like(name, seed=1)
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)


def _random_head(model: nn.Module, std: float) -> nn.Module:
    """torchvision initialises ViT's head to zeros: every output would be 0 and compare trivially.
    ``std`` keeps the logits apart enough that fp16 rounding does not swap near-tied classes."""
    nn.init.normal_(model.heads.head.weight, std=std)
    return model


def vit_tiny() -> nn.Module:
    """torchvision's ViT at a size CI converts in seconds: 32x32 images, 8x8 patches, 2 layers, hidden 64."""
    return _random_head(vit_tiny_zero_head(), std=0.5)


def vit_tiny_zero_head() -> nn.Module:
    """The tiny ViT as torchvision builds it: its zero head makes every output 0 (an inconclusive validation)."""
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=64, mlp_dim=128, num_classes=5)


def constant_output() -> nn.Module:
    """The tabular input through an MLP whose last layer has zero weights: the output is its bias for every input."""
    model = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 4))
    nn.init.zeros_(model[2].weight)
    return model


class BertEncoder(nn.Module):
    """transformers' BertModel (random weights) taking ids and a mask, returning the hidden states.

    The mask is ``attention_mask > 0``, so that the small random integers of validation inputs are a
    valid mask with a few padded positions.
    """

    def __init__(self, layers: int, hidden: int, heads: int):
        super().__init__()
        from transformers import BertConfig, BertModel  # a test extra, imported only by the models using it

        config = BertConfig(vocab_size=1000, num_hidden_layers=layers, hidden_size=hidden,
                            num_attention_heads=heads, intermediate_size=4 * hidden)
        self.bert = BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=(attention_mask > 0).long()).last_hidden_state


def bert_tiny() -> nn.Module:
    return BertEncoder(layers=2, hidden=64, heads=2)


def bert_base() -> nn.Module:
    """BERT-base's encoder size (12 layers, hidden 768): for measurements, too slow for CI."""
    return BertEncoder(layers=12, hidden=768, heads=12)


def vit_b_16() -> nn.Module:
    return _random_head(torchvision.models.vit_b_16(), std=768 ** -0.5)
