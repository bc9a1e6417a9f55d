"""fastformer.config: check_config on good and bad configs, and Config.load on files that are not configs."""

import warnings

import pytest

import fastformer
import fastformer.config
from fastformer import Config
from fastformer.config import TUTORIAL, check_config


def test_the_tutorials_config_and_fastformers_keys_pass():
    check_config(Config.tutorial())
    check_config(Config.tutorial(output_attentions=False, ffn_activation="relu", device="cuda"))
    check_config(Config.tutorial(n_head=4, d_head=64, d_hidn=128))  # n_head * d_head need not be d_hidn
    check_config(dict(TUTORIAL))  # any mapping, as the tutorial's own Config is one


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_layer": 0}, "config.n_layer must be a positive integer, got 0"),
        ({"n_layer": -2}, "config.n_layer must be a positive integer, got -2"),
        ({"d_ff": 64.5}, "config.d_ff must be a positive integer, got 64.5"),
        ({"d_hidn": 256.0}, "config.d_hidn must be a positive integer, got 256.0"),
        ({"n_head": True}, "config.n_head must be a positive integer, got True"),
        ({"d_head": "64"}, "config.d_head must be a positive integer, got '64'"),
        ({"n_enc_seq": 0}, "config.n_enc_seq must be a positive integer"),
        ({"n_output": 0}, "config.n_output must be a positive integer"),
        ({"i_pad": 8007}, r"config.i_pad must be a token id in 0..8006"),
        ({"i_pad": -1}, r"config.i_pad must be a token id"),
        ({"dropout": 1.0}, r"config.dropout is a probability in \[0, 1\), got 1.0"),
        ({"dropout": -0.1}, "config.dropout is a probability"),
        ({"dropout": float("nan")}, "config.dropout is a probability"),
        ({"layer_norm_epsilon": 0}, "config.layer_norm_epsilon must be a finite number > 0, got 0"),
        ({"layer_norm_epsilon": float("inf")}, "config.layer_norm_epsilon must be a finite number > 0"),
        ({"ffn_activation": "swish"}, "config.ffn_activation must be one of 'gelu', 'relu', got 'swish'"),
    ],
)
def test_bad_values_raise_one_line_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        check_config(Config.tutorial(**overrides))
    assert "\n" not in str(error.value)


def test_missing_keys_are_named():
    config = Config.tutorial()
    del config.n_layer, config.d_ff
    with pytest.raises(ValueError, match=r"^config is missing n_layer, d_ff$"):
        check_config(config)


def test_an_unknown_key_warns_once_naming_the_closest_known_key(monkeypatch):
    monkeypatch.setattr(fastformer.config, "_warned_keys", set())
    config = Config.tutorial(n_heads=8, colour="blue")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_config(config)
        check_config(config)
    messages = [str(w.message) for w in caught]
    assert messages == [
        "config key 'n_heads' is not one fastformer reads (did you mean 'n_head'?); it is ignored",
        "config key 'colour' is not one fastformer reads; it is ignored",
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", r"not a JSON config \(the file is empty\)"),
        ('{"n_layer": 6,', r"not a JSON config \(Expecting property name enclosed in double quotes at line 1"),
        ("n_layer = 6", r"not a JSON config \(Expecting value at line 1 column 1\)"),
        ("[1, 2]", "a config is a JSON object of keys and values, got a list"),
    ],
)
def test_load_names_the_file_that_is_not_a_config(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        Config.load(path)


def test_load_reads_a_config_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"n_layer": 6}', encoding="utf-8-sig")
    assert Config.load(path) == {"n_layer": 6}


def test_the_models_check_their_config_when_built():
    with pytest.raises(ValueError, match=r"^config.n_layer must be a positive integer, got 0$"):
        fastformer.MovieClassification(Config.tutorial(n_layer=0))
    without_output = {
        k: v for k, v in Config.tutorial(n_layer=1, d_hidn=16, d_ff=32, d_head=8).items() if k != "n_output"
    }
    fastformer.Transformer(Config(without_output))  # the Transformer does not read n_output
    with pytest.raises(ValueError, match=r"^config is missing n_output$"):
        fastformer.MovieClassification(Config(without_output))


@pytest.mark.parametrize(
    "overrides", [{}, {"n_head": 3, "d_head": 7, "n_dec_vocab": 11, "n_dec_seq": 3, "n_output": 5}]
)
def test_parameter_count_is_the_models(overrides):
    config = Config.tutorial(n_layer=2, **overrides)
    model = fastformer.MovieClassification(config)
    assert fastformer.config.parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_a_model_too_large_for_the_memory_names_the_size_out_of_scale():
    from fastformer.config import BYTES_TO_TRAIN, check_fits

    message = (
        r"^--n-output 1000000000: the model would have 256,015,290,368 parameters, 4,096,244,645,888 bytes "
        r"\(3.7 TiB\) to train .* more than the memory \(1.0 GiB\)$"
    )
    with pytest.raises(ValueError, match=message):
        check_fits(Config.tutorial(n_output=10**9), 2**30, "the memory", BYTES_TO_TRAIN, {"n_output": "--n-output"})
    check_fits(Config.tutorial(), 2**30, "the memory", BYTES_TO_TRAIN)  # 15 M parameters: 245 MB
    # the size out of scale, not the one whose product with it costs more (d_hidn, twice the
    # tutorial's, beside a vocab 375 times the tutorial's: vocab x d_hidn)
    for key in ("n_enc_vocab", "n_dec_vocab", "d_ff"):
        with pytest.raises(ValueError, match=rf"^config\.{key} 3000000: the model would have"):
            check_fits(Config.tutorial(d_hidn=512, **{key: 3 * 10**6}), 2**30, "the memory", BYTES_TO_TRAIN)
    # every size at the tutorial's or below: the one that costs the most
    with pytest.raises(ValueError, match=r"^config\.d_hidn 256: the model would have"):
        check_fits(Config.tutorial(), 2**20, "the memory", BYTES_TO_TRAIN)
