"""One command that validates fastformer on a CUDA GPU and leaves the answers in files.

    python -m tools.gpu_check --out DIR                      # every stage (25 minutes at most)
    python -m tools.gpu_check --out DIR --stage env,tests    # a subset; each stage alone ends within 9 minutes
    python -m tools.gpu_check --out DIR --quick              # a reduced matrix of every stage, under 9 minutes
    python -m tools.gpu_check --out DIR --smoke              # tiny shapes; on a CPU, kernels through the interpreter

Run it from the repository root of an installed checkout (`pip install -e .`; offline, with torch,
Triton and setuptools there: `pip install --no-deps --no-build-isolation --no-index -e .`): it
installs nothing and needs no network. The stages run in this order, whatever order --stage gives:

  env          GPU name, compute capability, SM count, memory, driver, CUDA, torch, Triton and
               Python versions; two ceilings measured on the spot: a bf16 GEMM of 8192^3
               (2 * 8192^3 FLOP per call) and a 1 GiB device-to-device copy (bytes read + written)
  tests        `pytest -m cuda` in a subprocess (bf16 parity included), writing junit.xml
  compile      torch.compile(model, fullgraph=True) of MovieClassification and of Aladdin
               Persson's einsum seq2seq Transformer: a train step (forward, loss, backward) checked finite, then the
               eval-mode logits against eager; on failure, Dynamo's graph breaks by reason and place
  determinism  attention forward + backward repeated on one input (without and with dropout), and
               train steps of the tutorial model from one seed, twice: every output, gradient and
               final weight bitwise equal, or the first mismatch (tensor, index, the two values)
  bench        the cases `python -m bench.report --targets` runs, fastformer against the peers
               measured in the same run; then, for the pairs where fastformer trailed a peer on the
               last GPU run (KERNEL_PROFILE), each one's kernels under torch.profiler: device time
               per kernel per call, the most first (where the time goes, ours beside the peer's)
  model        MovieClassification with the tutorial's config on batches of NSMC-like reviews (8 to
               128 tokens, padded): train step and inference for fastformer (bf16 autocast), the
               reference in fp32, under bf16 autocast, and compiled: tokens/s on real tokens, peak
               memory, MFU against the env stage's GEMM ceiling. Beside them, fastformer's ways of
               running a step (MODEL_VARIANTS): eager (the fastformer row), replayed from CUDA graphs
               (fastformer.train.graphs, `fastformer train --cuda-graphs`), torch.compile(model,
               fullgraph=True) over the Triton kernels (`--compile`), and the eager train step with
               `fastformer train`'s fused AdamW where the other rows step torch's default (the
               optimizer's part of the step). Then where the eager train step's host time goes:
               cProfile over the timed steps of fastformer and of the fp32 reference, each one's
               PROFILE_ROWS functions with the most time of their own (the host runs Python while
               the GPU waits), and what single calls cost this host (host_calls: an allocation, an
               aten op, the products, a Triton launch four ways). Then convergence: the same config
               (dropout 0) trained from one seed for a few dozen steps on real reviews
               (tests/data/rotten_tomatoes_200.tsv) on the Triton kernels and on the reference,
               both under the run's autocast, and on the reference in fp64; at every step
               |fastformer - fp64| <= 2 * max over the steps |reference - fp64| + atol

Each stage is timed and has a time budget (Plan below), checked between its items: cases left
when it is spent are reported as not run, and the stage fails. A stage's failure is recorded with
its traceback and the next stage runs. A stage that cannot run here is "skipped" with the reason
("needs CUDA: ..."). Exit status: 0 when no stage failed, 1 when one did, 2 for a bad command line.

--smoke runs the same pipeline on tiny shapes, on the GPU when there is one, else on the CPU with
the kernels through Triton's interpreter (so CI exercises it): there the ceilings, the compile
stage and the cuda tests say "needs CUDA", and the figures measured are CPU figures of tiny
shapes, never GPU ceilings. Without CUDA and without --smoke, env fails and the rest is skipped.

Files in DIR, at most 8 (earlier files of these names are replaced; other files are left alone):
  summary.md    stage table, targets, each stage's details, the benchmark tables, every traceback
  results.json  the schema below
  log.txt       everything printed, flushed as it goes (the pytest run's output included)
  junit.xml     the tests stage's pytest report
  plot-*.png    at most four: attention TFLOP/s against sequence length per provider, model tokens/s
results.json and summary.md are rewritten atomically (a temporary file, then os.replace) as each
stage starts and ends, and after each case in bench and model: a killed run leaves the stages it
finished and "running" on the one it was in.

results.json, schema "fastformer.gpu_check/1" (every key is always present; null where not known):
  schema, command, mode ("full" | "quick" | "smoke"), device ("cuda" | "cpu"),
  started, finished     ISO 8601 times; finished is null until the run ends
  env                   gpu (the device name, "cpu" without CUDA), torch, triton, cuda, date,
                        bf16_gemm_tflops, d2d_copy_gbps (null until measured; never on a CPU)
  units                 the unit of every figure, by key or key suffix (UNITS below)
  stages                {name: {status, seconds, reason, error, traceback, details}} for each stage
                        asked for, in run order; status is pending, running, passed, failed,
                        skipped or interrupted; reason says why a stage was skipped; error is
                        "Type: message" and traceback the full one for a failure; details holds
                        the stage's figures and always a one-line "summary":
      env           device, gpu, capability, sm_count, memory_gib, driver, cuda, torch, triton,
                    python, git_commit, bf16_gemm_tflops, d2d_copy_gbps, ceilings_note
      tests         command, returncode, timed_out, tests, passed, failed, errors, skipped,
                    seconds, failures (names and first message lines), skip_reasons
      compile       models: {name: {compiled, first_call_seconds, eval_first_call_seconds, step_ms,
                    eager_step_ms, max_abs_diff, tolerance, graph_breaks: [{reason, where}], error}}
      determinism   attention: {shape, dtype, mask, settings: [{setting, repetitions, mismatch}]},
                    training: {config, batch, amp, steps, mismatch}; a mismatch is {tensor, at,
                    index, first, second} (the first differing element of the first differing tensor)
      bench, model  cases, measured, skipped, failed, not_run; bench also kernel_profile: {case
                    id: [{kernel, calls_per_run, us_per_run, share}], the first row the case's
                    total, or {error}}, or {not_run}; model also rows (bench, provider,
                    ms, tokens_per_s, peak_mem_mb, tflops, mfu; the providers include
                    MODEL_VARIANTS), mfu_note, host_profile, host_calls ([{call, us_per_call, error?}]) and
                    convergence: {config,
                    batch, steps, reviews, amp, lr, curve: [{step, fastformer_loss, reference_loss,
                    reference_fp64_loss}], max_loss_diff, reference_max_loss_diff, loss_atol,
                    loss_tolerance, worst_step, agree}, or {not_run} when the budget was spent
  targets               bench.report's targets judged on this run's records: [{target, required,
                        worst, cases, met}]; worst is the worst ratio measured, met null when none
                        was (and on a CPU, where targets_note says why nothing is judged)
  targets_note          null on a GPU
  report                bench.report's schema ({env, results, skipped, failed}) holding the bench
                        and model stages' records (model's first where both measured a case), so
                        `python -m bench.report --from results.json` writes bench/results/<gpu>.json
  plots                 names of the PNGs written

The package, a module per stage and nothing importing another's privates:
  command.py   the command line, the log, the stages in order      plan.py    what each mode runs
  run.py       the run's state and files, and what stages share     report.py  summary.md and the table
  env.py, tests.py, compile.py, determinism.py, bench.py, model.py  the stages
"""

import os

import torch

# Triton reads this when a kernel is decorated, so it must be set before any module of this package
# imports `fastformer.kernels`: this file runs first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
