"""Word-level LSTM language models: PTB (SIDCo) and WikiText-2 (DEFT).

Training batches are independent windows of `bptt` tokens, each run from a zero initial
hidden state (the trainer treats batches as independent samples; no hidden state is
carried between steps, so batches can be sharded and shuffled like images). The window
grid is shifted by a random offset each epoch (shared by all ranks) so every token is
sometimes a window's first and sometimes its last. Evaluation follows the usual protocol:
the test stream in `eval_batch_size` columns, read in order with the hidden state carried
from window to window; perplexity = exp(mean token cross-entropy).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tasks import data as D
from tasks import hf_data
from tasks.base import Task, _mix, model_device, perplexity, register_task
from tasks.hyperparams import HParam, choice, count, flag, fraction


class LSTMLanguageModel(nn.Module):
    """Embedding → dropout → multi-layer LSTM (dropout between layers) → dropout → linear
    decoder, optionally tied to the embedding (Press & Wolf 2017; needs emb == hidden)."""

    def __init__(
        self,
        vocab: int,
        emb: int,
        hidden: int,
        layers: int,
        dropout: float,
        tied: bool,
        init_range: float = 0.1,
    ):
        super().__init__()
        if tied and emb != hidden:
            raise ValueError(f"tied weights need emb == hidden, got {emb} and {hidden}")
        self.embedding = nn.Embedding(vocab, emb)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(emb, hidden, layers, dropout=dropout if layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden, vocab)
        if tied:
            self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -init_range, init_range)
        if not tied:
            nn.init.uniform_(self.decoder.weight, -init_range, init_range)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: torch.Tensor, hidden=None):
        """tokens [T, B] → (logits [T, B, vocab], (h, c)); hidden None = zeros."""
        out, hidden = self.lstm(self.drop(self.embedding(tokens)), hidden)
        return self.decoder(self.drop(out)), hidden


class _LSTMTask(Task):
    metric = "perplexity"
    higher_is_better = False
    paper_vocab: int = 10_000
    extra_hparams: ClassVar[dict[str, HParam]] = {
        "bptt": count(required=True),  # tokens per training window
        "emb": count(required=True),  # embedding width
        "hidden": count(required=True),  # LSTM units per layer
        "layers": count(required=True),
        "dropout": fraction(required=True),
        "tied": flag(required=True),  # decoder tied to the embedding (needs emb == hidden)
        "eval_split": choice("valid", "test"),  # default: test
    }

    # data="hf": the Hub set's splits as the task's train/valid/test, one line per row of
    # the column `hf_text` (the rows are the lines of the canonical text files).
    hf_splits: ClassVar[dict[str, str] | None] = {
        "train": "train",
        "valid": "validation",
        "test": "test",
    }
    hf_text: ClassVar[str] = "text"
    # The paper's data set: its name, its files' name for tasks.data.load_word_corpus and
    # what data_source says of them (data="canonical").
    dataset: ClassVar[str] = ""
    corpus_name: ClassVar[str] = ""
    canonical_source: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        # the only column a text task reads is its text column: hf_columns follows hf_text
        super().__init_subclass__(**kwargs)
        cls.hf_columns = (cls.hf_text,)

    def __init__(self, **common: Any):
        super().__init__(**common)
        if self.data == "canonical":
            D.load_word_corpus(self.data_root, self.corpus_name)
            self.data_source = self.canonical_source
        elif self.data == "hf":
            hf_data.task_dataset(self)
            self.data_source = (
                f"{self.dataset}, {hf_data.describe(self)} (train; validation and test)"
            )
        else:
            self.data_source = self.standin_source()

    @abc.abstractmethod
    def standin_source(self) -> str:
        """What the offline stand-in is, for data_source; fails naming the install script
        where it is missing."""

    @abc.abstractmethod
    def standin_corpus(self) -> D.Corpus: ...

    def corpus(self) -> D.Corpus:
        if self.data == "canonical":
            return D.load_word_corpus(self.data_root, self.corpus_name)
        if self.data == "hf":
            return self._hf_corpus()
        return self.standin_corpus()

    def _hf_corpus(self) -> D.Corpus:
        """The corpus of the Hugging Face data set: every row of the text column is a line,
        split on whitespace with "<eos>" appended (tasks.data.tokenize_lines, the canonical
        loader's convention), the split into words cached by datasets' map."""
        dd = hf_data.task_dataset(self)
        column = self.hf_text

        def words(batch):
            return {"words": [line.split() + ["<eos>"] for line in batch[column]]}

        def make():
            splits = {}
            for ours, theirs in self.hf_splits.items():
                ds = hf_data.mapped(
                    dd[theirs], words, f"words-{column}-v1", remove_columns=dd[theirs].column_names
                )
                table = ds.data.column("words").combine_chunks()
                splits[ours] = table.flatten().to_pylist()
            return D.Corpus(splits)

        key = ("lm-hf", self.name, self.hf_source, self.data_root)
        return D.memo(key, make)

    @property
    def vocab_size(self) -> int:
        """At size="paper" the embedding/decoder keep the paper data set's vocabulary size
        (rows beyond the stand-in's vocabulary are never input), so every tensor has the
        paper's shape; at size="smoke" the data's own vocabulary."""
        n = len(self.corpus())
        return max(n, self.paper_vocab) if self.size == "paper" else n

    def build_model(self):
        h = self.hparams
        return LSTMLanguageModel(
            self.vocab_size, h["emb"], h["hidden"], h["layers"], h["dropout"], h["tied"]
        )

    def _train_ids(self) -> torch.Tensor:
        return self.corpus().ids["train"]

    def num_train(self) -> int:
        bptt = self.hparams["bptt"]
        return (len(self._train_ids()) - bptt) // bptt

    def _windows(self, indices: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        bptt = self.hparams["bptt"]
        ids = self._train_ids()
        starts = offset + indices * bptt
        pos = starts[None, :] + torch.arange(bptt)[:, None]  # [T, B]
        return ids[pos], ids[pos + 1]

    def make_batch(self, indices, generator):
        return self._windows(indices, 0)

    def train_batches(self, rank, world_size, epoch):
        offset = int(
            torch.randint(
                0,
                self.hparams["bptt"],
                (1,),
                generator=torch.Generator().manual_seed(_mix(self.seed, epoch, 7)),
            )
        )
        for row in self.epoch_indices(rank, world_size, epoch):
            yield self._windows(row.long(), offset)

    def batch_samples(self, batch) -> int:
        return int(batch[0].shape[1])  # sequences (each of bptt tokens)

    def loss(self, model, batch):
        x, y = batch
        dev = model_device(model)
        logits, _ = model(x.to(dev))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.to(dev).reshape(-1))

    def _evaluate(self, model, max_batches):
        split = (
            "valid"
            if len(self.corpus().ids["valid"]) and self.hparams.get("eval_split") == "valid"
            else "test"
        )
        ids = self.corpus().ids[split]
        cols, bptt = self.hparams["eval_batch_size"], self.hparams["bptt"]
        n = (len(ids) - 1) // cols
        if n < 1:
            raise ValueError(
                f"the {split} split ({len(ids)} tokens) is shorter than eval_batch_size={cols}"
            )
        src = ids[: n * cols].view(cols, n).t()  # [n, cols]
        tgt = ids[1 : n * cols + 1].view(cols, n).t()
        dev = model_device(model)
        hidden, total, tokens = None, 0.0, 0
        for b, i in enumerate(range(0, n, bptt)):
            if max_batches is not None and b >= max_batches:
                break
            logits, hidden = model(src[i : i + bptt].to(dev), hidden)
            y = tgt[i : i + bptt].to(dev)
            total += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"
                )
            )
            tokens += y.numel()
        return {"perplexity": perplexity(total, tokens), "loss": total / max(tokens, 1)}


@register_task("ptb_lstm")
class PTBLSTM(_LSTMTask):
    """2-layer LSTM (1500 units) language model on Penn Treebank (SIDCo).

    SIDCo Table 1: 66,034,000 parameters, Zaremba et al.'s large model. Hyper-parameters
    (SIDCo Table 1, Appendix D and the authors' dist_trainer.py / dl_trainer.py, which
    differ from Table 1 on momentum and the schedule): conf/task/ptb_lstm.yaml.

    Stand-in: the real PTB validation and test splits shipped beside the project
    (../shared/data/ptb): train on ptb.valid.txt, evaluate on ptb.test.txt. Without them,
    Shakespeare's plays normalised as PTB is (lower case, 10k vocabulary)."""

    paper = "SIDCo (Abdelmoniem et al., MLSys 2021), Table 1: LSTM / PTB"
    paper_param_count = (
        66_034_000  # 10k vocab: embedding 15M + 2 LSTM layers 36.024M + decoder 15.01M
    )
    paper_vocab = 10_000
    hf_text = "sentence"
    # The Hub's ptb_text_only is a loading script, which datasets 4 and later do not run.
    hf_hint = (
        "If load_dataset refuses the data set's loading script (datasets >= 4 runs none), "
        "add revision='refs/convert/parquet' (the Hub's parquet export; task.hf.revision) "
        "or use data='canonical' with ptb.train/valid/test.txt"
    )

    dataset = "Penn Treebank"
    corpus_name = "ptb"
    canonical_source = "Penn Treebank (ptb.train/valid/test.txt)"

    def standin_source(self):
        if D.shared_ptb_dir() is not None:
            return (
                "Penn Treebank, real splits: trained on ptb.valid.txt, evaluated on "
                "ptb.test.txt (the training split is not available offline)"
            )
        D.shakespeare_archive()
        return "Shakespeare plays, PTB-style normalisation (stand-in for PTB), split by play"

    def standin_corpus(self):
        shared = D.shared_ptb_dir()
        return D.load_ptb_valid_test(shared) if shared is not None else D.shakespeare_corpus("ptb")

    def paper_target(self):
        return 105.0  # SIDCo Appendix D: "The target test perplexity is 105 for PTB"


@register_task("wikitext2_lstm")
class WikiText2LSTM(_LSTMTask):
    """3-layer LSTM (650 units, tied) language model on WikiText-2 (DEFT).

    Hyper-parameters (DEFT Table 2, the DEFT authors' settings and their cnn-lstm code):
    conf/task/wikitext2_lstm.yaml."""

    paper = "DEFT (Yoon & Oh, ICPP 2023), Table 2: LSTM / WikiText-2"
    paper_param_count = None  # DEFT gives none; ours with the 33,278-word vocabulary: 31,819,578
    paper_vocab = 33_278  # WikiText-2's vocabulary size, <eos> included
    hf_text = "text"

    dataset = "WikiText-2"
    corpus_name = "wikitext2"
    canonical_source = "WikiText-2 (wiki.train/valid/test.tokens)"

    def standin_source(self):
        D.shakespeare_archive()
        return (
            "Shakespeare plays, WikiText-style tokens (case and punctuation kept, "
            "rare words <unk>; stand-in for WikiText-2), split by play"
        )

    def standin_corpus(self):
        return D.shakespeare_corpus("wikitext")

    def paper_target(self):
        # DEFT plots test perplexity without a target. 100 is our choice: within 10% of the
        # about 91 that PowerSGD (Vogels et al. 2019) reports for this model and recipe.
        return 100.0
