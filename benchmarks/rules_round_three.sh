#!/usr/bin/env bash
# Issue 56's comparison (docs/rules.md, "Round three: the comparison"): block verification, the static
# ensemble at three weights, MARS at its default and strict on the same drafts, HumanEval-30 and
# GSM8K-30. Every step resumes from its records.jsonl, so it can be stopped and rerun; a whole step only
# rewrites its summary. Many hours of CPU on 2 cores, over several sittings.
#
#   benchmarks/rules_round_three.sh seed ROOT      # copy the committed greedy runs whose records it reuses
#   benchmarks/rules_round_three.sh greedy ROOT    # the ensembles beside strict and MARS, greedy
#   benchmarks/rules_round_three.sh sampled [TASK] # T = 1, 3 samples: block, the ensembles, MARS, strict
#   benchmarks/rules_round_three.sh tables         # tables and Pareto plots of the whole runs
#   MARSPEC=/path/to/marspec benchmarks/rules_round_three.sh greedy runs/round-three
#
# ROOT holds the greedy run folders until they are whole (then they move to docs/results/); they start as
# copies of rivals-greedy-TASK-30 (strict and MARS's default decoded there, same configuration). A sampled
# run takes ~6 quiet hours and a sitting's machine is not kept, so it grows in docs/results/in-progress/
# (committed at the end of each sitting), starting as a copy of sweep-sampled-t1-TASK-30 (strict at T = 1,
# 3 samples, same configuration), and moves to docs/results/round-three-sampled-t1-TASK-30 once whole.
set -u
MARSPEC=${MARSPEC:-.venv/bin/marspec}
R=docs/results
ROOT=${2:-}
DEF=mars-prob@0.5  # the default MARS setting, greedy and sampling (marspec.defaults)
ENSEMBLES=ensemble@0.3,ensemble@0.6,ensemble@0.9
# The run-level theta and margin stay those of the folders seeded from, so their records are reused.
COMMON=(--margin prob_ratio --theta 0.5 --threads 2 --limit 30)

bench() { echo "=== $(date -u +%FT%TZ) bench $*"; "$MARSPEC" bench "$@" "${COMMON[@]}"; echo "=== rc $?"; }
# Twice with --redo-contended: the second pass decodes again what the first timed under load; strict is
# decoded again where its records were made on another CPU (a speed ratio pairs decodes of one CPU). The
# second pass also decodes again, back to back, a question whose methods were timed in different sittings.
step() { bench "$@" --redo-other-cpu --redo-contended; bench "$@" --redo-contended --redo-apart; }

usage() {
    echo "usage: $0 seed ROOT | greedy ROOT | sampled [humaneval|gsm8k] | tables" >&2
    exit 2
}
case "${1:-}" in
seed | greedy) [ -n "$ROOT" ] || usage ;;
esac
case "${1:-}" in
seed)
    for task in humaneval gsm8k; do
        [ -d "$ROOT/greedy-$task-30" ] || cp -r "$R/rivals-greedy-$task-30" "$ROOT/greedy-$task-30"
    done
    ;;
greedy)
    for task in humaneval gsm8k; do
        step --task $task --methods "strict,$DEF,$ENSEMBLES" --out "$ROOT/greedy-$task-30"
    done
    ;;
sampled)
    for task in ${2:-humaneval gsm8k}; do
        WHOLE=$R/round-three-sampled-t1-$task-30
        PART=$R/in-progress/round-three-sampled-t1-$task-30
        ARGS=(--task $task --temperature 1 --samples 3 --methods "strict,block,$DEF,$ENSEMBLES")
        if [ -d "$WHOLE" ]; then
            bench "${ARGS[@]}" --out "$WHOLE"  # decodes nothing: rewrites the summary
        else
            mkdir -p "$R/in-progress"
            [ -d "$PART" ] || cp -r "$R/sweep-sampled-t1-$task-30" "$PART"
            rm -f "$PART"/summary.* "$PART"/*.png  # the seed's, not this run's: written again once whole
            step "${ARGS[@]}" --out "$PART"
            if [ -f "$PART/summary.json" ]; then mv "$PART" "$WHOLE"; fi
        fi
    done
    ;;
tables)
    for run in "$R"/round-three-*-30; do
        python -m marspec.eval.rules_table "$run"
        "$MARSPEC" report "$run"
    done
    ;;
*) usage ;;
esac
