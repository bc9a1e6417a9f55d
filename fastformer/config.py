"""The tutorial's Config: a dict whose keys read and write as attributes, loadable from JSON."""
import json

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
        """Read a JSON file of keys and values, as the tutorial's Config.load does."""
        with open(file, "r", encoding="utf-8") as f:
            return cls(json.load(f))

    def save(self, file):
        """Write the config as JSON (values JSON cannot hold, such as a torch.device, as strings)."""
        with open(file, "w", encoding="utf-8") as f:
            json.dump(self, f, indent=2, default=str)
            f.write("\n")

    @classmethod
    def tutorial(cls, **overrides):
        """The tutorial's configuration, with any keys overridden."""
        return cls({**TUTORIAL, **overrides})
