"""One command that validates fastformer on a CUDA GPU, against the peers a user would pick
instead, and leaves the answers in files.

    python -m tools.gpu_check --out DIR            # the one run of a lease (plan.one_run): what decides first
    python -m tools.gpu_check --out DIR --quick    # the kernel and model stages, then the parity subset
    python -m tools.gpu_check --out DIR --rest     # the rest (env, tests, compile, determinism, job)
    python -m tools.gpu_check --out DIR --full     # every stage at full size (about 40 minutes)
    python -m tools.gpu_check --out DIR --smoke    # tiny shapes; on a CPU, kernels through the interpreter
    python -m tools.gpu_check --out DIR --quick --stage bench,model   # a mode's sizes, these stages

tools/gpu_run.sh is how a lent GPU machine runs it: one command of a lease of 15 minutes of device
time, the one run, planned for 540 s (--seconds), whose plan reads what the repository holds
(--repo: the committed sweep of this GPU model, the committed runs under bench/results/gpu/) and
says first what it runs and why; on a CPU it is its own rehearsal at smoke sizes. Run it from the
repository root of an installed checkout (`pip install -e .`; offline, with torch, Triton and
setuptools there: `pip install --no-deps --no-build-isolation --no-index -e .`): it installs
nothing and needs no network. The stages run in the plan's order (plan.py says what each mode
runs; --stage picks among them):

  env          GPU name, compute capability, SM count, memory, driver, CUDA, torch, Triton and
               Python versions; two ceilings measured on the spot: a bf16 GEMM of 8192^3
               (2 * 8192^3 FLOP per call) and a 1 GiB device-to-device copy (bytes read + written)
  sweep        tools.sweep in a subprocess (sweep.py): the kernels' variants and configs timed, a
               family at a time, sweep.json and sweep.md written into DIR as each family ends; then
               the tuned table tools.sweep.adopt makes of the report in force for the rest of the
               run (FASTFORMER_TUNED; env.tuned says which table every later figure ran on)
  tests        pytest in a subprocess, writing junit.xml: the `cuda` tests and the kernels' `parity`
               tests (every test that takes the `device` fixture) on the GPU, the plan's selection
               (tests.py); on a CPU, the GPU's selection counted and the cuda tests
  compile      torch.compile(model, fullgraph=True) of MovieClassification and of Aladdin
               Persson's einsum seq2seq Transformer: a train step (forward, loss, backward) checked
               finite, then the eval-mode logits against eager; on failure, Dynamo's graph breaks
  determinism  attention forward + backward repeated on one input (without and with dropout), and
               train steps of the tutorial model from one seed, twice: every output, gradient and
               final weight bitwise equal, or the first mismatch (tensor, index, the two values)
  bench        the kernel cases (bench.py's list for the mode: attention causal, no mask and padding
               + causal at L 4096, D128, fp16, the model's own attention call, the FFN, add +
               LayerNorm), fastformer against the peers in the same run (SDPA with PyTorch's choice
               of backend and each backend pinned, FlexAttention, torch.compile default and
               max-autotune, Liger-Kernel), each by device time (bench.timing: CUDA
               events, L2 flushed, 25+ calls, median and p20-p80) as called and replayed from a CUDA
               graph; then the kernels of the pairs the targets judge (KERNEL_PROFILE), device time
               per kernel per call under torch.profiler
  model        MovieClassification with the tutorial's config on batches of NSMC-like reviews (8 to
               128 tokens, padded): train step and inference by wall time per step (10+ steps,
               median and p20-p80) for every way of running it (bench.cases.MODEL_WAYS):
               fastformer eager, replayed from CUDA graphs, under torch.compile (fullgraph, and
               mode="reduce-overhead") and with the fused AdamW; the reference in fp32 and bf16, written
               with SDPA, compiled (default and reduce-overhead) and replayed from CUDA graphs:
               tokens/s on real tokens, peak and resident memory, MFU against the env stage's GEMM
               ceiling; the kernels of one step of fastformer's replayed step and of the fastest
               reference (step_kernels). Then where the eager train step's host time goes: cProfile
               over the timed steps of fastformer and of the fp32 reference, each one's PROFILE_ROWS
               functions with the most time of their own, and what single calls cost this host
               (host_calls). Then convergence: the same config (dropout 0) trained from one seed for
               a few dozen steps on real reviews (tests/data/rotten_tomatoes_200.tsv) on the Triton
               kernels and on the reference, both under the run's autocast, and on the reference in
               fp64; at every step |fastformer - fp64| <= 2 * max over the steps |reference - fp64| + atol
  job          the default job end to end, as a user runs it: `fastformer train --dataset
               rotten-tomatoes --epochs 1` on the Triton kernels, cold and warm (a second run on
               the Triton cache the first filled), and with --backend reference (the data from the
               sdist tools/gpu_carry.sh carries, else the embedded 200 reviews): wall time, time to
               first step, tokens/s over the epoch, test accuracy (job.py)

Each stage is timed and has a time budget (plan.py) on the run's clock (time an early stage leaves
goes to the later ones), checked between its items, which come in the order the decisions need
them: cases left when it is spent are reported as not run, with the reason, and the stage fails.
A stage's failure is recorded with its traceback and the next stage runs. A stage that cannot run
here is "skipped" with the reason ("needs CUDA: ..."). Exit status: 0 when no stage failed, 1 when
one did, 2 for a bad command line, 130 when interrupted.

--smoke runs the same pipeline on tiny shapes, on the GPU when there is one, else on the CPU with
the kernels through Triton's interpreter (so CI exercises it): every provider and kind of case is
a row there, measured or skipped with its reason; the ceilings, the compile stage and the cuda
tests say "needs CUDA", and the figures measured are CPU figures of tiny shapes, never GPU
ceilings; the sweep is a dry run under tools/sm90.py's driver. The one run on a CPU is the same
sizes in the one run's stages. Without CUDA, --full, --quick and --rest fail env and skip the rest.

Files in DIR, at most 6 in the one run, so that a stray temporary file leaves the device tool's 8
(earlier files of these names are replaced; other files are left alone):
  summary.md    the plan, stage table, targets, each stage's details, the benchmark tables, every traceback
  results.json  the schema below
  log.txt       everything printed, flushed as it goes (the pytest run's and the sweep's output included)
  junit.xml     the tests stage's pytest report
  sweep.json, sweep.md  the sweep stage's report and table (tools.sweep)
  plot-*.png    in the other modes, at most four: attention TFLOP/s against sequence length per
                provider, model tokens/s (bench.report --from results.json draws them from any run)
results.json and summary.md are rewritten atomically (a temporary file, then os.replace) as each
stage starts and ends, and after each case in bench and model; sweep.json and sweep.md after each
sweep family. Interrupted (SIGINT: tools/gpu_run.sh's limit signals the process group; a second
SIGINT is ignored, tools.interrupt_once), the run gives a subprocess 10 s to write its files, marks
the stage it was in "interrupted", writes its own and prints its summary, exit status 130; a
killed run leaves the stages it finished and "running" on the one it was in. The summary printed
last (the plan, the stages, the sweep's best per pass and what it put in force, the targets) is
the tail of the output a device tool returns even when no file comes back.

results.json, schema "fastformer.gpu_check/1" (every key is always present; null where not known):
  schema, command, mode ("one" | "full" | "quick" | "rest" | "smoke"), device ("cuda" | "cpu"),
  plan                  the lines that say what the run ran and why (the one run's; [] otherwise)
  started, finished     ISO 8601 times; finished is null until the run ends
  env                   gpu (the device name, "cpu" without CUDA), torch, triton, cuda, date,
                        bf16_gemm_tflops, d2d_copy_gbps (null until measured; never on a CPU),
                        tuned: {source, gpu, launches, sha256} of the tuned table the kernels read
                        (kernels/_tuned.py; sha256 of its launches, null for the written rules)
  units                 the unit of every figure, by key or key suffix (run.UNITS)
  stages                {name: {status, seconds, reason, error, traceback, details}} for each stage
                        asked for, in run order; status is pending, running, passed, failed,
                        skipped or interrupted; reason says why a stage was skipped; error is
                        "Type: message" and traceback the full one for a failure; details holds
                        the stage's figures and always a one-line "summary":
      env           device, gpu, capability, sm_count, memory_gib, driver, cuda, torch, triton,
                    python, git_commit, bf16_gemm_tflops, d2d_copy_gbps, ceilings_note
      sweep         command, returncode, timed_out, families, interrupted, seconds, launches, timed,
                    compiled, not_timed, error, errors, best (a line per family: each pass's fastest
                    against the rule's pick), adopted (the lines of what it put in force)
      tests         command, returncode, timed_out, tests, passed, failed, errors, skipped,
                    seconds, failures (names and first message lines), skip_reasons, selection
                    (the mode), gpu_command, selected_on_gpu and parity_on_gpu (counted on a CPU)
      compile       models: {name: {compiled, first_call_seconds, eval_first_call_seconds, step_ms,
                    eager_step_ms, max_abs_diff, tolerance, graph_breaks: [{reason, where}], error}}
      determinism   attention: {shape, dtype, mask, settings: [{setting, repetitions, mismatch}]},
                    training: {config, batch, amp, steps, mismatch}; a mismatch is {tensor, at,
                    index, first, second} (the first differing element of the first differing tensor)
      bench, model  cases, measured, skipped, failed, not_run; bench also kernel_profile: {case
                    id: [{kernel, calls_per_run, us_per_run, share}], the first row the case's
                    total, or {error}}; model also rows ({bench, provider, ms, p20_ms, p80_ms,
                    tokens_per_s, peak_mem_mb, resident_mb, tflops, mfu}), mfu_note, step_kernels
                    ({provider: kernel rows}), memory_phases ({path: {before_step_mb,
                    forward_peak_mb, backward_peak_mb, optimizer_peak_mb}}: tools.memory.phases),
                    host_profile, host_calls ([{call, us_per_call, error?}]) and convergence:
                    {config, batch, steps, reviews, amp, lr, curve: [{step, fastformer_loss,
                    reference_loss, reference_fp64_loss}], max_loss_diff, reference_max_loss_diff,
                    loss_atol, loss_tolerance, worst_step, agree}; each of the last five {not_run}
                    when the budget was spent (memory_phases on a CPU too)
      job           budget_seconds, data, data_note, data_command, and per job (triton, on an empty
                    Triton cache; triton_warm, on the cache it filled; reference):
                    command, returncode, timed_out, timeout_seconds, wall_seconds, setup_seconds,
                    first_step_seconds (the job's own, metrics.json), train_seconds, tokens_per_s,
                    accuracy, steps, step_mode, eager_because, kernels, amp, device, max_steps (or
                    error and last_lines)
  targets               bench.targets judged on this run's records: [{target, kind,
                        required, cases, worst, low, high, basis, peer, verdict, met}]; worst is the
                        worst case's figure and [low, high] its interval, basis the figure compared
                        (graph, events, wall), verdict met, not met, within noise or not measured
                        (on a CPU "not judged (CPU)", and targets_note says why); met is true or
                        false where the verdict is met or not met, else null
  targets_note          null on a GPU
  report                bench.report's schema ({env, results, skipped, failed}) holding the bench
                        and model stages' records (bench.common.RECORD_KEYS, mfu, and
                        kernels where profiled; model's first where both measured a case), so
                        `python -m bench.report --from results.json` writes bench/results/<gpu>.json
  plots                 names of the PNGs written

The package, a module per stage and nothing importing another's privates:
  command.py   the command line, the log, the stages in order      plan.py    what each mode runs
  run.py       the run's state and files, and what stages share     report.py  summary.md and the table
  env.py, sweep.py, tests.py, compile.py, determinism.py, bench.py, model.py, job.py    the stages
"""

import os

import torch

# Triton reads this when a kernel is decorated, so it must be set before any module of this package
# imports `fastformer.kernels`: this file runs first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
