"""The tutorial's Config: a dict whose keys read and write as attributes, loadable from JSON, and
`check_config`, which the model and the job run on it before building anything."""

import difflib
import json
import math
import numbers
import os
import warnings

from fastformer.data.files import check_file

# The tutorial's configuration (its vocab: 8000 BPE pieces + 7 special symbols).
TUTORIAL = {
    "n_enc_vocab": 8007,
    "n_dec_vocab": 8007,
    "n_enc_seq": 256,
    "n_dec_seq": 256,
    "n_layer": 6,
    "d_hidn": 256,
    "i_pad": 0,
    "d_ff": 1024,
    "n_head": 4,
    "d_head": 64,
    "dropout": 0.1,
    "layer_norm_epsilon": 1e-12,
    "n_output": 2,
}
SIZES = (
    "n_enc_vocab",
    "n_dec_vocab",
    "n_enc_seq",
    "n_dec_seq",
    "n_layer",
    "d_hidn",
    "d_ff",
    "n_head",
    "d_head",
    "n_output",
)
# Keys read when present: fastformer's two (see Config) and the device the tutorial's scripts store.
OPTIONAL = {"output_attentions": (None, True, False), "ffn_activation": ("gelu", "relu"), "device": None}
MAX_SIZE = 2**63 - 1  # torch's sizes are int64: no tensor dimension is larger

_warned_keys = set()  # unknown keys already warned about in this process


class Config(dict):
    """A dict with attribute access, as in the tutorial: `config.d_hidn == config["d_hidn"]`.

    fastformer reads two optional keys of its own: `output_attentions` (see fastformer.model) and
    `ffn_activation` ("gelu", the tutorial's and the default, or "relu").
    """

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"Config has no key {name!r} (keys: {', '.join(sorted(self))})") from None

    def __setattr__(self, name, value):
        self[name] = value

    def __delattr__(self, name):
        del self[name]

    @classmethod
    def load(cls, file):
        """Read a JSON file of keys and values, as the tutorial's Config.load does. A file that is
        not a JSON object raises ValueError naming it."""
        return cls(read_json_object(file, "config"))

    def save(self, file):
        """Write the config as JSON (values JSON cannot hold, such as a torch.device, as strings)."""
        with open(file, "w", encoding="utf-8") as f:
            json.dump(self, f, indent=2, default=str)
            f.write("\n")

    @classmethod
    def tutorial(cls, **overrides):
        """The tutorial's configuration, with any keys overridden."""
        return cls({**TUTORIAL, **overrides})


def read_json_object(path, what):
    """The JSON object in `path`, or ValueError naming the file and what is wrong with it; `what`
    names the kind of file in the message ("config", "run file")."""
    check_file(path, f"{what} file")
    try:
        with open(path, encoding="utf-8-sig") as f:
            value = json.load(f)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a JSON {what} (not UTF-8 text at byte {error.start})") from None
    except json.JSONDecodeError as error:
        empty = not error.doc.strip()
        detail = "the file is empty" if empty else f"{error.msg} at line {error.lineno} column {error.colno}"
        raise ValueError(f"{path}: not a JSON {what} ({detail})") from None
    except (ValueError, RecursionError) as error:  # an integer of over 4300 digits; nesting too deep
        detail = "nested too deeply" if isinstance(error, RecursionError) else str(error).split(";")[0]
        raise ValueError(f"{path}: not a JSON {what} that fastformer reads ({detail})") from None
    except OSError as error:
        raise OSError(f"could not read {path}: {error.strerror or error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a {what} is a JSON object of keys and values, got a {type(value).__name__}")
    return value


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value):
    """Whether a real number is finite as a float: an integer too large for one (10**400) is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value):
    """repr(value) for a message, an integer of more than 30 digits by its count of digits (str()
    of one over 4,300 digits raises ValueError)."""
    if not _is_int(value) or abs(value) < 10**30:
        return repr(value)
    magnitude = abs(int(value))
    digits = int(math.log10(magnitude)) + 1
    digits += magnitude >= 10**digits  # log10 rounds near a power of ten
    digits -= magnitude < 10 ** (digits - 1)
    return f"{'a negative' if value < 0 else 'an'} integer of {digits} digits"


def check_size(name, value):
    """Raise ValueError naming `name` (config.d_hidn, or the option it came from) unless value is
    an integer in 1..MAX_SIZE, a size torch can make a tensor of."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {_shown(value)}")
    if value > MAX_SIZE:
        raise ValueError(f"{name} must be at most 2**63 - 1 (torch's largest size), got {_shown(value)}")


def check_config(config, classifier=False):
    """Raise ValueError naming the first key of `config` (any mapping) that the model cannot be
    built from; warn once per process about each key it does not read, naming the closest known key.
    n_output is required only for a classifier (MovieClassification); the Transformer does not read it.

    Every size is an integer in 1..2**63 - 1 (check_size); n_head * d_head is the attention width the
    tutorial projects d_hidn to and back from, so it need not equal d_hidn (the tutorial's ELECTRA uses
    d_hidn 128 with 4 heads of 64); i_pad is a token id of both vocabs; dropout is in [0, 1);
    layer_norm_epsilon is a finite number > 0.
    """
    missing = [key for key in TUTORIAL if key not in config and (classifier or key != "n_output")]
    if missing:
        raise ValueError(f"config is missing {', '.join(missing)}")
    for key in SIZES:
        if key in config:
            check_size(f"config.{key}", config[key])
    i_pad, n_vocab = config["i_pad"], min(config["n_enc_vocab"], config["n_dec_vocab"])
    if not _is_int(i_pad) or not 0 <= i_pad < n_vocab:
        raise ValueError(f"config.i_pad must be a token id in 0..{n_vocab - 1} (the vocab sizes), got {_shown(i_pad)}")
    dropout = config["dropout"]
    if not isinstance(dropout, numbers.Real) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise ValueError(f"config.dropout is a probability in [0, 1), got {_shown(dropout)}")
    eps = config["layer_norm_epsilon"]
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not (_is_finite(eps) and eps > 0):
        raise ValueError(f"config.layer_norm_epsilon must be a finite number > 0, got {_shown(eps)}")
    for key, allowed in OPTIONAL.items():
        if allowed is not None and key in config and config[key] not in allowed:
            raise ValueError(f"config.{key} must be one of {', '.join(map(repr, allowed))}, got {_shown(config[key])}")
    known = [*TUTORIAL, *OPTIONAL]
    for key in config:
        if key not in known and key not in _warned_keys:
            _warned_keys.add(key)
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            warnings.warn(f"config key {key!r} is not one fastformer reads{hint}; it is ignored", stacklevel=2)


# Memory: what a config's parameters take, checked before a model is built.

BYTES_TO_TRAIN = 16  # per parameter: the fp32 weight, its gradient and AdamW's two moments
BYTES_TO_BUILD = 4  # per parameter: the fp32 weight, as MovieClassification(config) builds it on the host


def parameter_count(config):
    """The parameters of MovieClassification(config), the frozen position tables included (of
    Transformer(config) when config has no n_output)."""
    d, d_ff, d_attn = config["d_hidn"], config["d_ff"], config["n_head"] * config["d_head"]
    attention = 4 * d * d_attn + 3 * d_attn + d  # W_Q, W_K, W_V: d -> d_attn; linear: d_attn -> d
    ffn = 2 * d * d_ff + d_ff + d  # conv1 and conv2
    norm = 2 * d
    n_layer = config["n_layer"]
    encoder = (config["n_enc_vocab"] + config["n_enc_seq"] + 1) * d + n_layer * (attention + ffn + 2 * norm)
    decoder = (config["n_dec_vocab"] + config["n_dec_seq"] + 1) * d + n_layer * (2 * attention + ffn + 3 * norm)
    return encoder + decoder + d * config.get("n_output", 0)


def activation_count(config, batch_size, seq_len):
    """A lower bound of the elements one training step of MovieClassification(config) keeps for its
    backward, at batch_size reviews padded to seq_len pieces, the decoder reading one [BOS] as the
    job feeds it: per encoder layer and position Q, K, V and the attention's output (4 x n_head x
    d_head), the FFN's pre-activation (d_ff) and the inputs of its two add + LayerNorms (2 x d_hidn);
    per decoder layer the cross-attention's keys and values over the encoder's positions (2 x
    n_head x d_head). Either backend keeps at least these (the reference keeps the attention's
    probabilities too); the many smaller tensors are left out."""
    d_attn, n_layer = config["n_head"] * config["d_head"], config["n_layer"]
    encoder = 4 * d_attn + config["d_ff"] + 2 * config["d_hidn"]
    return n_layer * batch_size * seq_len * (encoder + 2 * d_attn)


def host_memory():
    """The bytes of memory this machine has, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def size_text(n_bytes):
    """1.5 GiB, 20.0 TiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n_bytes < 1024 or unit == "PiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024


def check_fits(config, memory, where, per_parameter, names=None):
    """Raise ValueError when the parameters of `config` (checked by check_config) at
    `per_parameter` bytes each (BYTES_TO_BUILD, BYTES_TO_TRAIN) take more than `memory` bytes
    (`where`: "this machine's memory"; `memory` None: unknown, nothing is checked). The message names the
    size out of scale (the one whose tutorial value would save the most memory, then the one that costs
    the most): as config.<key>, or as names[key] (the option it came from). A size no tensor can have
    (check_size) raises its ValueError first, so a size set by an option that check_config has not
    seen is named too."""
    for key in SIZES:
        if key in config:
            check_size((names or {}).get(key, f"config.{key}"), config[key])
    needed = parameter_count(config) * per_parameter
    if memory is None or needed <= memory:
        return

    # the size out of scale: the one that, set back to the tutorial's value, saves the most (then:
    # set to 1); a config ten times wider than the tutorial's everywhere blames what costs the most
    def saved(key, value):
        return needed - parameter_count({**config, key: value}) * per_parameter

    key = max((k for k in SIZES if k in config), key=lambda k: (saved(k, min(config[k], TUTORIAL[k])), saved(k, 1)))
    name = (names or {}).get(key, f"config.{key}")
    what = (
        "to train (the weight, its gradient and AdamW's two moments"
        if per_parameter == BYTES_TO_TRAIN
        else ("to build (the fp32 weights alone")
    )
    raise ValueError(
        f"{name} {config[key]}: the model would have {parameter_count(config):,} parameters, {needed:,} bytes "
        f"({size_text(needed)}) {what}, {per_parameter} bytes each), more than {where} ({size_text(memory)})"
    )
