"""The tutorial's SentencePiece vocab: BPE pieces plus seven special symbols at fixed ids."""

import io
import itertools
import os
import re
import threading
import time

from fastformer.data.files import PROGRESS_DELAY, check_file
from fastformer.progress import progress_bar

# (id, piece) of the four control symbols, as the tutorial trains them; then three user symbols.
PAD, UNK, BOS, EOS = (0, "[PAD]"), (1, "[UNK]"), (2, "[BOS]"), (3, "[EOS]")
USER_SYMBOLS = ("[SEP]", "[CLS]", "[MASK]")
N_SPECIAL = 4 + len(USER_SYMBOLS)  # the tutorial's "vocab_size + 7"


def _spm():
    try:
        import sentencepiece
    except ImportError as error:  # a dependency of the package; say so if it is missing
        raise ImportError("fastformer's vocab needs sentencepiece: pip install sentencepiece") from error
    return sentencepiece


MAX_SENTENCES = 2_000_000  # reviews SentencePiece trains on at most: a uniform sample of a larger corpus


def train_vocab(texts, model_file, n_pieces=8000, progress=False):
    """Train a BPE vocab the tutorial's way on an iterable of texts and write it to `model_file`.

    The vocab holds `n_pieces` learned pieces plus the 7 special symbols ([PAD] 0, [UNK] 1,
    [BOS] 2, [EOS] 3, [SEP], [CLS], [MASK]), as the tutorial's `--vocab_size={vocab_size + 7}`.
    On a small corpus it holds fewer, as many as the corpus supports. The texts are read once, as
    SentencePiece takes them (none is kept here); of a corpus of more than MAX_SENTENCES texts it
    trains on a uniform sample of that many. `progress`: a bar, shown after a few seconds, of the
    texts read and then of the time the training has taken. Returns the loaded vocab.
    """
    if n_pieces < 1:
        raise ValueError(f"n_pieces must be positive, got {n_pieces}")
    texts = (t for t in texts if t)
    first = next(texts, None)
    if first is None:
        raise ValueError("cannot train a vocab on an empty corpus")
    model = io.BytesIO()
    try:
        with _Progress(progress) as shown:
            _spm().SentencePieceTrainer.train(
                sentence_iterator=shown.reading(itertools.chain([first], texts)),
                model_writer=model,
                vocab_size=n_pieces + N_SPECIAL,
                model_type="bpe",
                max_sentence_length=999999,
                input_sentence_size=MAX_SENTENCES,
                shuffle_input_sentence=True,
                pad_id=PAD[0],
                pad_piece=PAD[1],
                unk_id=UNK[0],
                unk_piece=UNK[1],
                bos_id=BOS[0],
                bos_piece=BOS[1],
                eos_id=EOS[0],
                eos_piece=EOS[1],
                user_defined_symbols=list(USER_SYMBOLS),
                hard_vocab_limit=False,  # a small corpus gets a smaller vocab instead of an error
                minloglevel=2,
            )
    except RuntimeError as error:
        # e.g. "... Vocabulary size is smaller than required_chars. 8 vs 42. ...": the corpus's
        # characters and the special symbols each need a piece
        needed = re.search(r"required_chars\. \d+ vs (\d+)", str(error))
        if needed is None:
            raise ValueError(f"SentencePiece could not train a vocab of {n_pieces} pieces: {error}") from None
        raise ValueError(
            f"a vocab of {n_pieces} pieces is too small for this corpus: its characters alone need "
            f"{int(needed.group(1)) - N_SPECIAL}"
        ) from None
    try:
        with open(model_file, "wb") as f:
            f.write(model.getvalue())
    except OSError as error:  # a full disk, a file size limit: name the file
        raise OSError(error.errno, error.strerror, model_file) from None
    return load_vocab(model_file)


class _Progress:
    """train_vocab's progress bar: the texts SentencePiece has read, then, while it trains (it lets
    go of the GIL), the time the training has taken, refreshed every second by a thread (in a log,
    fastformer.progress writes a line of it now and then). Shown after PROGRESS_DELAY seconds, gone
    when the training ends."""

    def __init__(self, enabled):
        self.bar = progress_bar(desc="Vocab: reading", unit=" texts", disable=not enabled, delay=PROGRESS_DELAY)
        self.done = threading.Event()
        self.ticker = None

    def reading(self, texts):
        """texts, counted on the bar as they are read; once they are all read, the ticker starts."""
        for text in texts:
            self.bar.update()
            yield text
        self.bar.set_description(f"Vocab: training BPE on {self.bar.n:,} texts", refresh=False)
        if not self.bar.disable:
            self._refresh()
            self.ticker = threading.Thread(target=self._tick, daemon=True)
            self.ticker.start()

    def _refresh(self):
        """Redraw the bar, once its delay has passed (before, it shows nothing, as tqdm's own updates)."""
        if time.time() - self.bar.start_t >= self.bar.delay:
            self.bar.refresh()

    def _tick(self):
        while not self.done.wait(1.0):
            self._refresh()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.ticker is not None:
            self.ticker.join()
        self.bar.close()


def check_utf8_path(path, what):
    """Raise ValueError unless `path` is UTF-8 text: SentencePiece takes the path of a vocab as
    UTF-8, and a name with bytes that are not (os.fsdecode's surrogate escapes on Linux) cannot
    reach it. `what` names the path ("vocab file", "run directory")."""
    try:
        os.fsdecode(path).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"the {what} path {os.fsencode(path)!r} is not UTF-8: SentencePiece reads a vocab by a UTF-8 path, "
            f"so the path of a {what} must be UTF-8; rename it"
        ) from None


def load_vocab(model_file):
    """Load a SentencePiece model and check it has the tutorial's special symbols at their ids."""
    check_utf8_path(model_file, "vocab file")
    check_file(model_file, "vocab file")
    vocab = _spm().SentencePieceProcessor()
    try:
        vocab.load(model_file)
    except (OSError, RuntimeError) as error:
        raise ValueError(f"{model_file} is not a SentencePiece model ({error})") from None
    for id_, piece in (PAD, UNK, BOS, EOS):
        if id_ >= vocab.get_piece_size() or vocab.id_to_piece(id_) != piece:
            found = vocab.id_to_piece(id_) if id_ < vocab.get_piece_size() else None
            raise ValueError(
                f"vocab {model_file} does not have {piece} at id {id_} (it has {found!r}); "
                "train it with fastformer.data.train_vocab or the tutorial's flags"
            )
    return vocab


WORD_START = "\u2581"  # SentencePiece's word-boundary mark, a piece of its own before an unknown word


def known_pieces(vocab, text):
    """How many of text's pieces the vocab knows: neither [UNK] nor a bare word-boundary mark (which
    SentencePiece puts before a word of characters it has never seen: "😀" is ["▁", [UNK]])."""
    unknown = {vocab.unk_id(), vocab.piece_to_id(WORD_START)}
    return sum(1 for i in vocab.encode_as_ids(text) if i not in unknown)


def check_vocab_matches(vocab, config, vocab_name="vocab"):
    """Raise ValueError if the vocab's ids do not fit the config's embeddings or padding id."""
    size = vocab.get_piece_size()
    if size > config.n_enc_vocab:
        raise ValueError(
            f"{vocab_name} has {size} pieces but config.n_enc_vocab is {config.n_enc_vocab}: "
            "the ids would not fit the embedding"
        )
    if vocab.pad_id() != config.i_pad:
        raise ValueError(f"{vocab_name} pads with id {vocab.pad_id()} but config.i_pad is {config.i_pad}")
