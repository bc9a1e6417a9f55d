"""The `fastformer` command: each subcommand parses its arguments and calls its job in
fastformer.train.job (`train` with one fastformer.train.run.TrainOptions built from them).

Imports nothing heavy at the top, so `fastformer --help` and `--version` answer at once. Each
command checks its options and files first, without torch (fastformer.train.run for `train`), so
that a mistake is reported in a fraction of a second; torch and Triton load after. Errors are one
line on stderr: exit 2 for bad input (nothing is written), 1 when training stops on a NaN or
infinite loss, 130 on Ctrl-C, and 128 + the signal's number when SIGTERM, SIGHUP, SIGQUIT or SIGUSR1
stops it as Ctrl-C does (`train` names its last checkpoint). Options are spelt in full: `--epoch 1`
is refused, not read as --epochs, and the one line names the nearest option (or command) and the
help of the command that was given the typo. A reader that closes the pipe early (`fastformer
predict ... | head -1`) ends the command quietly, with SIGPIPE's status, 141.
`python -m fastformer` runs the same command, which is how torchrun starts it: `torchrun
--nproc_per_node N -m fastformer train ...`.
"""

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import signal
import sys
import warnings

from fastformer.version import __version__


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, like the command's other errors, and that
    reads `--lr -1e-3` as a value: argparse's own rule (Python 3.11's) takes only `-1` and `-.5` for
    negative numbers, and anything else that starts with "-" for an option. It takes no
    abbreviation of an option, `--epoch 1` or `--epoch=1` for `--epochs 1`, and neither do the
    subcommands' parsers, which add_subparsers makes of this class. A misspelt option or choice is
    answered with the nearest one (difflib's), and an argument that a subcommand's options do not
    take is reported by that subcommand, with its help and its options."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
        self._commands = None  # add_subparsers' action
        self._near = None  # for error()'s hint: the option or choice nearest to one given wrong

    def add_subparsers(self, **kwargs):
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)  # for error()'s hint
        self._near = None
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # the subcommand's parser left them: it names its own help and options
            command = getattr(parsed, self._commands.dest, None) if self._commands else None
            (self._commands.choices[command] if command else self)._unrecognized(extras)
        return parsed

    def _unrecognized(self, extras):
        """error() for the arguments `extras` that no option of this parser takes, naming the
        option nearest to the first --option among them that is near one (the names compared
        without their dashes, which every option shares)."""
        names = {option.lstrip("-"): option for action in self._actions for option in action.option_strings}
        for arg in extras:
            given = arg.partition("=")[0].lstrip("-") if arg.startswith("--") else ""
            near = difflib.get_close_matches(given, names, n=1) if given else []
            if near:
                self._near = names[near[0]]
                break
        self.error(f"unrecognized arguments: {' '.join(extras)}")

    def _check_value(self, action, value):
        # argparse's message quotes the choices or not, and suggests one or not, by Python version:
        # this one is the same on each, and error() suggests the nearest choice
        if action.choices is not None and value not in action.choices:
            choices = [str(choice) for choice in action.choices]
            near = difflib.get_close_matches(str(value), choices, n=1)
            self._near = near[0] if near else None
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {', '.join(choices)})")

    def error(self, message):
        hint = f"see {self.prog} --help"
        if self._near is not None:
            hint = f"did you mean {self._near}? {hint}"
        dashed = [arg for arg in getattr(self, "_given", ()) if _LEADING_DASH.match(arg) and arg != "-h"]
        if dashed:  # a text that starts with "-" reads as an option (fastformer's options are --long)
            hint = f"a text that starts with '-', such as {dashed[0]!r}, goes after `--`; {hint}"
        self.exit(2, f"{self.prog}: error: {message} ({hint})\n")


_LEADING_DASH = re.compile(r"^-[^-\d.]")  # "-bad", not "--option", "-1e-3" or "-.5"


@contextlib.contextmanager
def _torch():
    """Import torch and run the block on cpu_threads() threads, then restore the count."""
    import torch

    from fastformer.train.runtime import cpu_threads

    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _job_options(args, *names):
    """The parsed options `names` as keyword arguments of a job: each option's dest is the name of
    the job's parameter it sets."""
    return {name: getattr(args, name) for name in names}


def _demo(args):
    from fastformer.train.run import check_demo_options

    check_demo_options(args.device, args.backend_name, args.amp, args.batch_size, args.seq_len, args.seed)
    with _torch():
        from fastformer.train import job

        job.demo(**_job_options(args, "device", "backend_name", "amp", "batch_size", "seq_len", "seed"))
    return 0


def _train(args):
    from fastformer.train.run import TrainOptions, check_inputs, run_dir_held

    inputs = check_inputs(TrainOptions.from_args(args))
    with run_dir_held(inputs), _torch():
        from fastformer.train import job

        job.train_inputs(inputs)
    return 0


def _data(args):
    """Prepare a real review corpus: `fastformer data rotten-tomatoes`."""
    from fastformer.data import rotten_tomatoes

    rotten_tomatoes.prepare(cache=args.cache, source=args.source)
    cache = os.path.abspath(args.cache or rotten_tomatoes.default_cache())
    if cache == os.path.abspath(rotten_tomatoes.default_cache()):
        print("Train on it: fastformer train --dataset rotten-tomatoes")
    else:
        from fastformer.train.rundir import shell_word

        files = rotten_tomatoes.split_files(cache)
        print(f"Train on it: fastformer train --train {shell_word(files['train'])} --test {shell_word(files['test'])}")
    return 0


def _evaluate(args):
    from fastformer.data.files import check_file
    from fastformer.train.run import check_run_options
    from fastformer.train.rundir import check_run_dir

    check_run_options(args.device, args.backend_name, args.amp, args.batch_size)
    args.run = _run_dir(args.run)
    check_run_dir(args.run)
    if args.test is not None:
        check_file(args.test, "test file")
    with _torch():
        from fastformer.train import job

        options = _job_options(args, "run", "test", "batch_size", "device", "backend_name", "amp", "cuda_graphs")
        job.evaluate_run(**options)
    return 0


def _predict(args):
    from fastformer.train.run import check_run_options, check_texts
    from fastformer.train.rundir import check_run_dir

    check_texts(args.texts)
    check_run_options(args.device, args.backend_name, args.amp)
    args.run = _run_dir(args.run)
    check_run_dir(args.run)
    with _torch():
        from fastformer.train import job

        job.predict(**_job_options(args, "run", "texts", "device", "backend_name", "amp"))
    return 0


def _run_dir(run):
    """--run's directory: `last` resolved (fastformer.train.rundir.resolve_run), and said on stderr,
    with why it is not a finished run where it is not one (rundir.unfinished)."""
    from fastformer.train.rundir import resolve_run, unfinished

    found = resolve_run(run)
    if found != run:
        note = unfinished(found)
        print(f"--run {run}: {found}{f': {note}' if note else ''}", file=sys.stderr)
    return found


_RUN_HELP = "a run directory written by `fastformer train`, or `last`: the one runs/latest points at"


def _add_flags(parser, flags):
    """Add the options `flags` declares, {dest: argparse's arguments, "flag" where the option is not
    --the-dest-with-dashes} (fastformer.train.run: TrainOptions' fields, RUNTIME_FLAGS)."""
    for dest, spec in flags.items():
        spec = dict(spec)
        name = spec.pop("flag", "--" + dest.replace("_", "-"))
        parser.add_argument(name, dest=dest, **spec)


def _add_runtime_options(parser):
    from fastformer.train.run import RUNTIME_FLAGS

    _add_flags(parser, RUNTIME_FLAGS)


def build_parser():
    from fastformer.train.run import TrainOptions  # light: no torch, no sentencepiece

    parser = _Parser(
        prog="fastformer",
        description="The Transformer of paul-hyun's tutorial (paul-hyun.github.io/transformer-01), drop-in, "
        "with Triton kernels on CUDA.",
    )
    parser.add_argument("--version", action="version", version=f"fastformer {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="what to do; `fastformer COMMAND --help` says more of each"
    )

    demo = commands.add_parser(
        "demo",
        help="build the tutorial model, run one forward and backward, and print what it did",
        description="Build the tutorial's MovieClassification (its config: 6 layers, d_hidn 256, a vocab of "
        "8,007), run one forward and backward on a batch of random reviews under the autocast `fastformer train` "
        "would use (or --amp's), and print the loss, the gradient norm, the time and where the math ran. "
        "Nothing is written.",
    )
    demo.set_defaults(run_command=_demo)
    _add_runtime_options(demo)
    demo.add_argument("--batch-size", type=int, default=8, help="random reviews in the batch (default: 8)")
    demo.add_argument(
        "--seq-len", type=int, default=64, help="their length in tokens, at most the config's 256 (default: 64)"
    )
    demo.add_argument("--seed", type=int, default=0, help="the seed of the weights and the batch (default: 0)")

    train = commands.add_parser(
        "train",
        help="train the vocab and the sentiment classifier (default: on the embedded demo set)",
        description="Train a SentencePiece vocab and the tutorial's MovieClassification on labelled reviews "
        "(NSMC TSV or the tutorial's JSONL), evaluate each epoch, and write a run directory. With no "
        "arguments it runs on the embedded demo set: the tutorial's config on CUDA, a smaller one on CPU.",
    )
    train.set_defaults(run_command=_train)
    _add_flags(train, {field.name: field.metadata["argparse"] for field in dataclasses.fields(TrainOptions)})

    data = commands.add_parser(
        "data",
        help="prepare a real review corpus for `fastformer train`",
        description="Prepare the Rotten Tomatoes snippets (10,605 English review sentences rated by people, from "
        "the vaderSentiment 3.3.2 sdist, MIT licence): fetch the sdist with pip (sha256 pinned), read it in "
        "memory, and write train.tsv and test.tsv (NSMC format, 85/15 split by id) into the cache.",
    )
    data.set_defaults(run_command=_data)
    data.add_argument("dataset", choices=["rotten-tomatoes"], help="the corpus")
    data.add_argument(
        "--cache",
        metavar="DIR",
        help="where the sdist and train.tsv/test.tsv go (default $XDG_CACHE_HOME/fastformer/rotten-tomatoes, "
        "else ~/.cache/fastformer/rotten-tomatoes)",
    )
    data.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        help="convert this vaderSentiment-3.3.2.tar.gz (or its hutto_ICWSM_2014.tar.gz) instead of downloading",
    )

    evaluate = commands.add_parser(
        "evaluate",
        help="accuracy of a trained run on a test file",
        description="Load the model of a run directory that `fastformer train` wrote and print its accuracy and "
        "loss on labelled reviews: the test file the run was trained with, or --test's (a run trained on a "
        "held-out split of its --train needs --test). Nothing is written.",
    )
    evaluate.set_defaults(run_command=_evaluate)
    evaluate.add_argument("--run", metavar="DIR", required=True, help=_RUN_HELP)
    evaluate.add_argument("--test", metavar="FILE", help="test reviews (default: the run's test file)")
    evaluate.add_argument("--batch-size", type=int, default=128, help="reviews per batch (default: 128)")
    _add_runtime_options(evaluate)
    evaluate.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="replay each batch from a CUDA graph, one per bucket length (default: where it applies: CUDA, "
        "bf16 or no autocast)",
    )

    predict = commands.add_parser(
        "predict",
        help="classify texts with a trained run",
        description="Load the model of a run directory that `fastformer train` wrote and print, one line per "
        "TEXT, the label it predicts, its probability and the text. A TEXT that starts with '-' goes after "
        "`--`. Nothing is written.",
    )
    predict.set_defaults(run_command=_predict)
    predict.add_argument("--run", metavar="DIR", required=True, help=_RUN_HELP)
    predict.add_argument("texts", nargs="+", metavar="TEXT", help="reviews to classify")
    _add_runtime_options(predict)
    return parser


STOP_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")  # those this platform has


@contextlib.contextmanager
def _stop_signals():
    """While a command runs, the STOP_SIGNALS that would end the process without a word (theirs is
    the default action) raise KeyboardInterrupt where it is, so that it stops as on Ctrl-C: a run
    names its last checkpoint, temporary files go. Yields the list the signals received go in.
    Outside the main thread, or where a signal has a handler already, nothing changes."""
    received = []

    def stop(signum, _frame):
        received.append(signum)
        raise KeyboardInterrupt

    installed = {}
    for name in STOP_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            if signal.getsignal(signum) == signal.SIG_DFL:
                installed[signum] = signal.signal(signum, stop)
        except ValueError:  # not the main thread: signals are the main thread's
            break
    try:
        yield received
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)


def _quiet_stdout():
    """After a broken pipe: stdout goes nowhere, so that the interpreter's last flush at exit does
    not report the pipe once more."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def paths_print_as_given():
    """Let stdout and stderr print a path whose bytes are not UTF-8 (os.fsdecode's surrogate escapes)
    as those bytes, as `ls` does, rather than fail with UnicodeEncodeError after the work is done."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):  # replaced by a test, or closed
            if stream.encoding.lower().replace("-", "") == "utf8":
                stream.reconfigure(errors="surrogateescape")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    prog = f"fastformer {args.command}"
    paths_print_as_given()

    def show_warning(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=sys.stderr)

    received = []
    try:
        if getattr(args, "backend_name", "") is None:  # no --backend: the environment's, else auto
            from fastformer.train.run import default_backend

            args.backend_name = default_backend()
        with warnings.catch_warnings(), _stop_signals() as received:
            warnings.showwarning = show_warning
            return args.run_command(args)
    except BrokenPipeError:  # the reader of stdout went away: nothing more to say to it
        _quiet_stdout()
        return 128 + signal.SIGPIPE  # as a process that SIGPIPE ended
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except FloatingPointError as error:  # a NaN or infinite loss (fastformer.train.loop.NonFiniteLossError)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        if _torchrun_rank() not in (None, 0) and not str(interrupt):
            pass  # rank 0 says how the job stopped and names its last checkpoint, for every process
        else:
            how = f"stopped by {signal.Signals(received[0]).name}" if received else "interrupted"
            print(f"{prog}: {how}{f'; {interrupt}' if str(interrupt) else ''}", file=sys.stderr)
        return 128 + received[0] if received else 130


def _torchrun_rank():
    """This process's rank in a torchrun job ($RANK), or None outside one."""
    from fastformer.environment import under_torchrun

    if not under_torchrun():
        return None
    try:
        return int(os.environ["RANK"])
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
