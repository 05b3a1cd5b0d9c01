"""Image classification workloads: CIFAR-10/100, ImageNet and CIFAR-10 at 224 pixels.

Models are built here (CIFAR ResNets and VGG, MLP-Mixer) or taken from torchvision
(ResNet-50, VGG-19, ViT-B/16; imported lazily). The offline stand-in for every image task
is Fashion-MNIST (Debian dataset-fashion-mnist): 28×28 grey images zero-padded to 32×32
and repeated to 3 channels (then resized for the 224-pixel and ImageNet models). At
size="paper" the models keep the paper's classification head (1000 ImageNet classes, 100
CIFAR-100 classes) whatever the data, so every gradient tensor has the paper's shape; the
stand-in's 10 labels use the first 10 outputs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tasks import data as D
from tasks.base import Task, accuracy_counts, model_device, register_task

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# -- models ----------------------------------------------------------------------------------------
class _ShortcutA(nn.Module):
    """He et al. (2016) option A: stride-2 subsampling and zero-padded extra channels
    (parameter-free, as in the CIFAR ResNet-20 of SIDCo)."""

    def __init__(self, extra: int):
        super().__init__()
        self.extra = extra

    def forward(self, x):
        x = x[:, :, ::2, ::2]
        return F.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))


class _BlockA(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = _ShortcutA(cout - cin) if (stride != 1 or cin != cout) else nn.Identity()

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32×32 inputs (He et al. 2016, Sec. 4.2): 3 stages of n basic
    blocks with widths w, 2w, 4w, option-A shortcuts, global average pooling, one FC."""

    def __init__(self, depth: int = 20, width: int = 16, num_classes: int = 10):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"depth={depth}: a CIFAR ResNet has depth 6n+2 (20, 32, 44, 56, 110)")
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                blocks.append(_BlockA(cin, cout, 2 if (stage > 0 and i == 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        _kaiming(self)

    def forward(self, x):
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(x.mean(dim=(2, 3)))


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _projection(cin, planes, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.shortcut = _projection(cin, planes * 4, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


def _projection(cin, cout, stride):
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class CifarResNetV1(nn.Module):
    """ImageNet ResNet-18/50 blocks adapted to 32×32 inputs (3×3 stem, no max-pool,
    1×1 projection shortcuts): the ResNet-18 of DEFT's and PowerSGD's CIFAR code and the
    usual CIFAR-100 ResNet-50."""

    def __init__(
        self,
        bottleneck: bool,
        blocks: tuple[int, ...],
        widths=(64, 128, 256, 512),
        num_classes: int = 10,
    ):
        super().__init__()
        block = _Bottleneck if bottleneck else _Basic
        self.conv = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        layers, cin = [], widths[0]
        for stage, (n, planes) in enumerate(zip(blocks, widths)):
            for i in range(n):
                layers.append(block(cin, planes, 2 if (stage > 0 and i == 0) else 1))
                cin = planes * block.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)
        _kaiming(self)

    def forward(self, x):
        x = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(x.mean(dim=(2, 3)))


VGG_CFG = {
    "vgg16": (
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    ),
    "smoke": (16, "M", 32, "M", 32, "M", 64, "M", 64, "M"),
}


class CifarVGG(nn.Module):
    """VGG for 32×32 inputs as in SIDCo's models/vgg.py: 3×3 convolutions with batch norm,
    five max-pools down to 1×1, one Linear(512, classes)."""

    def __init__(self, cfg: tuple, num_classes: int = 10):
        super().__init__()
        layers, cin = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [
                    nn.Conv2d(cin, v, 3, padding=1),
                    nn.BatchNorm2d(v),
                    nn.ReLU(inplace=True),
                ]
                cin = v
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


class SmallImageNetVGG(nn.Module):
    """torchvision's VGG layout (features, 7×7 adaptive pool, three-layer classifier with
    dropout) at a width small enough for CI; size="paper" uses torchvision.models.vgg19."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.5):
        super().__init__()
        cfg = (16, "M", 32, "M", 64, "M", 64, "M")
        layers, cin = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(
            nn.Linear(cin * 4, 128),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(128, 128),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(128, num_classes),
        )
        for m in self.modules():  # torchvision's conv initialisation (its N(0, 0.01) FC init
            if isinstance(m, nn.Conv2d):  # is too slow to start for a 20-step check)
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens)
        )
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.channel_mlp = nn.Sequential(
            nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim)
        )

    def forward(self, x):  # [B, tokens, dim]
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    """MLP-Mixer (Tolstikhin et al. 2021): per-patch linear embedding, `depth` blocks of
    token-mixing and channel-mixing MLPs, global average pooling, linear head.
    Mixer-B/16: patch 16, dim 768, token MLP 384, channel MLP 3072, depth 12."""

    def __init__(
        self,
        image_size=224,
        patch=16,
        dim=768,
        depth=12,
        token_hidden=384,
        channel_hidden=3072,
        num_classes=1000,
    ):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size={image_size} is not a multiple of patch={patch}")
        tokens = (image_size // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, patch)
        self.blocks = nn.Sequential(
            *[MixerBlock(tokens, dim, token_hidden, channel_hidden) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def _kaiming(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def load_pretrained(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a state dict (torch.save'd) into `model`, skipping only tensors whose shape
    differs (the classification head when fine-tuning on fewer classes)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"pretrained weights {path} not found")
    sd = torch.load(path, map_location="cpu", weights_only=True)
    sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
    own = model.state_dict()
    keep = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
    missing = [k for k in own if k not in keep]
    if len(missing) > 4:  # more than a head's weight/bias (+ norm) means the wrong file
        raise ValueError(
            f"{path} does not fit this model: {len(missing)} tensors missing or mis-shaped, "
            f"e.g. {missing[:5]}"
        )
    model.load_state_dict(keep, strict=False)
    return model


# -- data pipeline ---------------------------------------------------------------------------------
def random_crop_flip(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Per-image random crop (zero padding `pad`) and horizontal flip, vectorised."""
    b, c, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    rows = (oy[:, None] + torch.arange(h))[:, None, :, None]
    cols = (ox[:, None] + torch.arange(w))[:, None, None, :]
    out = xp[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    flip = torch.rand(b, generator=gen) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


class ImageTask(Task):
    """Shared data handling: in-memory uint8 images (Fashion-MNIST or CIFAR pickles) or an
    ImageFolder tree (ImageNet), per-batch augmentation, top-1/top-5 evaluation."""

    canonical: str = "cifar10"  # cifar10 | cifar100 | imagenet
    paper_image_size: int = 32
    smoke_image_size: int = 32
    paper_classes: int = 10
    normalize: str = "dataset"  # dataset statistics, or "half" (mean 0.5, std 0.5: ViT/Mixer)

    def __init__(self, *, loader_workers: int = 4, **common: Any):
        super().__init__(**common)
        self.loader_workers = loader_workers
        self.image_size = self.paper_image_size if self.size == "paper" else self.smoke_image_size
        self._folder = None
        if self.data == "standin":
            D.fashion_mnist_dir()  # fail now, naming the install script
            self.data_source = "Fashion-MNIST (stand-in for {}), padded to 32×32×3{}".format(
                {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "imagenet": "ImageNet"}[
                    self.canonical
                ],
                f", resized to {self.image_size}×{self.image_size}"
                if self.image_size != 32
                else "",
            )
        elif self.canonical == "imagenet":
            root = Path(self.data_root)
            for split in ("train", "val"):
                if not (root / split).is_dir():
                    raise D.missing_canonical(
                        f"ImageNet {split}/ (ImageFolder: one sub-folder of images per class)",
                        root / split,
                        "download ILSVRC2012 from https://image-net.org and arrange train/ "
                        "and val/ in "
                        "class folders (e.g. with the PyTorch examples' valprep.sh)",
                    )
            self.data_source = f"ImageNet (ImageFolder at {root})"
        else:
            n = 10 if self.canonical == "cifar10" else 100
            D.load_cifar(self.data_root, n)
            self.data_source = f"CIFAR-{n}" + (
                f", resized to {self.image_size}×{self.image_size}" if self.image_size != 32 else ""
            )

    @property
    def num_classes(self) -> int:
        """Outputs of the model: the paper's head at size="paper", else the data's classes."""
        if self.size == "paper":
            return self.paper_classes
        return (
            100
            if (self.data == "canonical" and self.canonical == "cifar100")
            else (1000 if (self.data == "canonical" and self.canonical == "imagenet") else 10)
        )

    # -- in-memory arrays ----------------------------------------------------------------------
    def arrays(self) -> dict[str, torch.Tensor]:
        if self.data == "standin":
            return D.load_fashion_mnist()
        return D.load_cifar(self.data_root, 10 if self.canonical == "cifar10" else 100)

    def _stats(self):
        if self.normalize == "half":
            return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        if self.data == "standin":
            return (FMNIST_MEAN,) * 3, (FMNIST_STD,) * 3
        return {
            "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
            "cifar100": (CIFAR100_MEAN, CIFAR100_STD),
            "imagenet": (IMAGENET_MEAN, IMAGENET_STD),
        }[self.canonical]

    def _prepare(self, x_uint8: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        x = x_uint8.float().div_(255.0)
        if x.ndim == 3:  # grey [B, H, W] → [B, 3, H, W]
            x = x[:, None].expand(-1, 3, -1, -1)
        if x.shape[-1] < 32:
            p = (32 - x.shape[-1]) // 2
            x = F.pad(x, (p, 32 - x.shape[-1] - p, p, 32 - x.shape[-2] - p))
        if gen is not None:
            x = random_crop_flip(x, 4, gen)
        if self.image_size != x.shape[-1]:
            x = F.interpolate(
                x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        mean, std = self._stats()
        return (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]

    # -- ImageFolder (ImageNet) ----------------------------------------------------------------
    def _image_folder(self, split: str):
        import torchvision.datasets as tvd
        import torchvision.transforms as T

        key = ("imagefolder", split, str(Path(self.data_root).resolve()), self.image_size)
        norm = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        if split == "train":
            tf = T.Compose(
                [T.RandomResizedCrop(self.image_size), T.RandomHorizontalFlip(), T.ToTensor(), norm]
            )
        else:
            tf = T.Compose(
                [
                    T.Resize(int(self.image_size * 256 / 224)),
                    T.CenterCrop(self.image_size),
                    T.ToTensor(),
                    norm,
                ]
            )
        return D.memo(key, lambda: tvd.ImageFolder(str(Path(self.data_root) / split), transform=tf))

    def num_train(self) -> int:
        if self.data == "canonical" and self.canonical == "imagenet":
            return len(self._image_folder("train"))
        return int(self.arrays()["train_y"].numel())

    def make_batch(self, indices: torch.Tensor, generator: torch.Generator | None) -> tuple:
        if self.data == "canonical" and self.canonical == "imagenet":
            ds = self._image_folder("train")
            items = [ds[int(i)] for i in indices]
            return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])
        a = self.arrays()
        return self._prepare(a["train_x"][indices], generator), a["train_y"][indices]

    def train_batches(self, rank, world_size, epoch):
        if not (self.data == "canonical" and self.canonical == "imagenet"):
            yield from super().train_batches(rank, world_size, epoch)
            return
        from torch.utils.data import DataLoader

        from tasks.base import _mix

        batches = self.epoch_indices(rank, world_size, epoch).tolist()
        loader = DataLoader(
            self._image_folder("train"),
            batch_sampler=batches,
            num_workers=self.loader_workers,
            generator=torch.Generator().manual_seed(_mix(self.seed, epoch, rank + 1)),
        )
        yield from loader

    def loss(self, model, batch):
        x, y = batch
        dev = model_device(model)
        return F.cross_entropy(model(x.to(dev, non_blocking=True)), y.to(dev, non_blocking=True))

    def _eval_batches(self, split: str):
        bs = self.hparams["eval_batch_size"]
        if self.data == "canonical" and self.canonical == "imagenet":
            from torch.utils.data import DataLoader

            yield from DataLoader(
                self._image_folder("val"), batch_size=bs, num_workers=self.loader_workers
            )
            return
        a = self.arrays()
        x, y = a[f"{split}_x"], a[f"{split}_y"]
        if split == "train":  # a fixed subset of the training split, no augmentation
            keep = torch.randperm(len(y), generator=torch.Generator().manual_seed(12345))[:10_000]
            x, y = x[keep], y[keep]
        for i in range(0, len(y), bs):
            yield self._prepare(x[i : i + bs], None), y[i : i + bs]

    def _accuracy(self, model, split: str, max_batches: int | None) -> tuple[float, float]:
        dev = model_device(model)
        n = top1 = top5 = 0
        for b, (x, y) in enumerate(self._eval_batches(split)):
            if max_batches is not None and b >= max_batches:
                break
            logits = model(x.to(dev)).float().cpu()
            c1, c5 = accuracy_counts(logits, y, ks=(1, min(5, logits.shape[1])))
            top1, top5, n = top1 + c1, top5 + c5, n + len(y)
        return top1 / max(n, 1), top5 / max(n, 1)

    def _evaluate(self, model, max_batches):
        acc, top5 = self._accuracy(model, "test", max_batches)
        return {"accuracy": acc, "top5": top5}


@register_task("cifar10_resnet20")
class Cifar10ResNet20(ImageTask):
    """ResNet-20 on CIFAR-10 (SIDCo).

    He et al.'s option-A ResNet-20. Hyper-parameters (SIDCo Table 1, Appendix D and the
    authors' dl_trainer.py): conf/task/cifar10_resnet20.yaml."""

    metric = "accuracy"
    paper = "SIDCo (Abdelmoniem et al., MLSys 2021), Table 1: ResNet-20 / CIFAR-10"
    # SIDCo Table 1 prints 269,467. Ours, He et al.'s option-A ResNet-20, has 269,722
    # (conv 267,696 + BN 1,376 + FC 650); no standard ResNet-20 variant we tried gives the
    # paper's figure (255 fewer), so the test pins our own count and records the gap.
    paper_param_count = 269_467

    def paper_target(self):
        return 0.75  # SIDCo Appendix D: "target test accuracy is 75% for ResNet20"

    def build_model(self):
        if self.size == "paper":
            return CifarResNet(20, 16, self.num_classes)
        return CifarResNet(8, 8, self.num_classes)


@register_task("cifar10_vgg16")
class Cifar10VGG16(ImageTask):
    """VGG-16 on CIFAR-10 (SIDCo).

    The model is the authors' code's (models/vgg.py: batch norm after every convolution,
    one Linear(512, 10)). Hyper-parameters (SIDCo Table 1): conf/task/cifar10_vgg16.yaml."""

    metric = "accuracy"
    paper = "SIDCo (Abdelmoniem et al., MLSys 2021), Table 1: VGG-16 / CIFAR-10"
    # SIDCo Table 1 prints 14,982,987; the authors' models/vgg.py gives 14,728,266 (ours).
    # The paper's figure is exactly VGG-16 *without* batch norm (14,714,688 conv) plus
    # Linear(512, 512) and Linear(512, 11): an 11-way head, the same "+1 class" pattern as its
    # ImageNet counts (1001 classes), so the paper counted a different (TF-style) model.
    paper_param_count = 14_982_987

    def paper_target(self):
        return 0.80  # SIDCo Appendix D: "80% for VGG16 on CIFAR-10"

    def build_model(self):
        return CifarVGG(VGG_CFG["vgg16" if self.size == "paper" else "smoke"], self.num_classes)


@register_task("cifar10_resnet18")
class Cifar10ResNet18(ImageTask):
    """ResNet-18 on CIFAR-10 (DEFT).

    The CIFAR ResNet-18 (3×3 stem, no max-pool). Hyper-parameters (DEFT Table 2 and the
    authors' cnn-lstm/run.py): conf/task/cifar10_resnet18.yaml."""

    metric = "accuracy"
    paper = "DEFT (Yoon & Oh, ICPP 2023), Table 2: ResNet-18 / CIFAR-10"
    paper_param_count = None  # DEFT gives none; ours (CIFAR ResNet-18) has 11,173,962

    def paper_target(self):
        # DEFT reports accuracy curves but no target; 0.90 is our choice (ResNet-18 reaches
        # about 0.95 on CIFAR-10 with this schedule), stated as such in the README.
        return 0.90

    def build_model(self):
        if self.size == "paper":
            return CifarResNetV1(False, (2, 2, 2, 2), num_classes=self.num_classes)
        return CifarResNetV1(
            False, (1, 1, 1, 1), widths=(8, 16, 32, 64), num_classes=self.num_classes
        )


@register_task("cifar100_resnet50")
class Cifar100ResNet50(ImageTask):
    """ResNet-50 on CIFAR-100 (THC simulations).

    Hyper-parameters (THC Section 8.3's batch, the common CIFAR-100 ResNet recipe for the
    rest): conf/task/cifar100_resnet50.yaml. THC's target is 95% *training* accuracy
    (Fig. 8), so the metric is accuracy on a fixed 10,000-image subset of the training
    split (no augmentation); test accuracy is reported as "accuracy" beside it."""

    canonical = "cifar100"
    paper_classes = 100
    metric = "train_accuracy"
    paper = "THC (Li et al., 2024), Section 8.3: ResNet-50 / CIFAR-100, batch 128"
    paper_param_count = None  # THC gives none; ours (CIFAR ResNet-50, 100 classes): 23,705,252

    def paper_target(self):
        return 0.95  # THC Section 8.3: "the target train accuracy of 95%"

    def build_model(self):
        if self.size == "paper":
            return CifarResNetV1(True, (3, 4, 6, 3), num_classes=self.num_classes)
        return CifarResNetV1(
            True, (1, 1, 1, 1), widths=(8, 16, 32, 64), num_classes=self.num_classes
        )

    def _evaluate(self, model, max_batches):
        acc, top5 = self._accuracy(model, "test", max_batches)
        train_acc, _ = self._accuracy(model, "train", max_batches)
        return {"train_accuracy": train_acc, "accuracy": acc, "top5": top5}


class _ImageNetTask(ImageTask):
    canonical = "imagenet"
    paper_image_size = 224
    smoke_image_size = 32
    paper_classes = 1000
    metric = "top5"


@register_task("imagenet_resnet50")
class ImageNetResNet50(_ImageNetTask):
    """ResNet-50 on ImageNet (SIDCo, DRAGONN, THC).

    torchvision's ResNet-50 with SIDCo's setting (Table 1, Appendix D and the authors'
    dl_trainer.py: conf/task/imagenet_resnet50.yaml). Metric: top-5 accuracy, THC's
    time-to-accuracy metric; top-1 ("accuracy", SIDCo's) is reported beside it."""

    paper = "SIDCo Table 1 (ResNet-50 / ImageNet); THC Section 7 target"
    # SIDCo prints 25,559,081 = torchvision's 25,557,032 + 2,049: a 1001-way head (2048
    # weights + 1 bias more), the TF-style "background" class. ImageNet has 1000 classes.
    paper_param_count = 25_559_081

    def paper_target(self):
        return 0.905  # THC Section 7: ResNet50 "reaches the 90.5% target accuracy" (top-5)

    def build_model(self):
        from torchvision.models.resnet import Bottleneck, ResNet, resnet50

        if self.size == "paper":
            return resnet50(weights=None, num_classes=self.num_classes)
        return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=self.num_classes, width_per_group=16)


@register_task("imagenet_vgg19")
class ImageNetVGG19(_ImageNetTask):
    """VGG-19 on ImageNet (SIDCo, THC).

    torchvision's VGG-19 (no batch norm) with SIDCo's setting (Table 1, Appendix D and the
    authors' dl_trainer.py: conf/task/imagenet_vgg19.yaml). Metric: top-5 accuracy (THC's
    VGG target)."""

    paper = "SIDCo Table 1 (VGG-19 / ImageNet); THC Section 7 target"
    # SIDCo prints 143,671,337 = torchvision's 143,667,240 + 4,097: a 1001-way head.
    paper_param_count = 143_671_337

    def paper_target(self):
        # THC Section 7: "VGG16 ... reaches the 90% target accuracy" (its Fig. 4 caption
        # names VGG19); top-5.
        return 0.90

    def build_model(self):
        if self.size == "paper":
            from torchvision.models import vgg19

            return vgg19(weights=None, num_classes=self.num_classes)
        return SmallImageNetVGG(self.num_classes, dropout=0.0)


class _FineTune224(ImageTask):
    """DRAGONN Section 5.1: fine-tune on CIFAR-10 at 224×224×3 (Adam; lr and batch in
    conf/task/<name>.yaml) from ImageNet-21k weights (Ridnik et al. 2021). Those weights
    cannot be fetched offline: pass weights=PATH (a state dict for this model); without it
    the model starts from random initialisation, which data_source states."""

    paper_image_size = 224
    smoke_image_size = 32
    normalize = "half"
    metric = "accuracy"

    def __init__(self, *, weights: str | None = None, **common: Any):
        super().__init__(**common)
        if weights is not None and not Path(weights).exists():
            raise FileNotFoundError(f"weights={weights!r} not found")
        self.weights = weights
        self.data_source += (
            f"; initial weights {weights}"
            if weights
            else "; model randomly initialised (the paper fine-tunes ImageNet-21k weights)"
        )

    def paper_target(self):
        return 0.94  # DRAGONN Table 2: speed-ups "when reaching 94% accuracy in Cifar10"

    def build_model(self):
        model = self._build()
        return load_pretrained(model, self.weights) if self.weights else model


@register_task("cifar10_vit")
class Cifar10ViT(_FineTune224):
    """ViT-B/16 fine-tuned on CIFAR-10 at 224×224 (DRAGONN); torchvision's VisionTransformer."""

    paper = "DRAGONN (Wang et al., 2022), Section 5.1: ViT / CIFAR-10"
    paper_param_count = None  # DRAGONN gives none; ViT-B/16 with a 10-way head: 85,806,346

    def _build(self):
        from torchvision.models.vision_transformer import VisionTransformer

        if self.size == "paper":
            return VisionTransformer(224, 16, 12, 12, 768, 3072, num_classes=self.num_classes)
        return VisionTransformer(32, 8, 2, 2, 32, 64, num_classes=self.num_classes)


@register_task("cifar10_mixer")
class Cifar10Mixer(_FineTune224):
    """MLP-Mixer-B/16 fine-tuned on CIFAR-10 at 224×224 (DRAGONN)."""

    paper = "DRAGONN (Wang et al., 2022), Section 5.1: MLP-Mixer / CIFAR-10"
    paper_param_count = None  # DRAGONN gives none; Mixer-B/16 with a 10-way head: 59,119,162

    def _build(self):
        if self.size == "paper":
            return MLPMixer(224, 16, 768, 12, 384, 3072, num_classes=self.num_classes)
        return MLPMixer(32, 8, 32, 2, 16, 64, num_classes=self.num_classes)
