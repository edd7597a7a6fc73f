#!/usr/bin/env bash
# Issue 37's measurements (docs/rules.md, "Round two: the runs"), one command each. Every
# step resumes from its records.jsonl, so it can be stopped and rerun; a whole step only rewrites its
# summary. Hours of CPU on 2 cores, resumed over several sittings.
#
#   benchmarks/rules_round_two.sh compare      # FLy x 3 and the class-guarded MARS beside the first
#                                              # comparison's rules, HumanEval-30 and GSM8K-30 (~1.6 h)
#   benchmarks/rules_round_two.sh speed-again  # strict and round two's methods decoded again back to
#                                              # back in both folders, for their speed (~1.8 h)
#   benchmarks/rules_round_two.sh gsm8k250     # paired greedy GSM8K, questions 51-300 (~12 h)
#   benchmarks/rules_round_two.sh tables       # the tables and plots docs/results.md takes from them
#   MARSPEC=/path/to/marspec benchmarks/rules_round_two.sh compare
set -u
MARSPEC=${MARSPEC:-.venv/bin/marspec}
R=docs/results
DEF=mars-prob@0.5  # the default MARS setting (marspec.defaults)
RIVALS=typical@0.09,typical@0.2,typical@0.4,pthresh@0.1,pthresh@0.25,pthresh@0.4,topk@2,topk@3,topk@5
# FLy at its sources' threshold with windows 6 (their default), 3 and 1: with k = 12 and the draft's
# confidence stop, a mismatch is deferrable only where `window` more draft tokens follow it, so the window
# decides how often FLy can act at all on this pair.
FLY=fly@0.3,fly-w3@0.3,fly-w1@0.3
GUARDED=$DEF+class
# The rival at MARS's speed in the first comparison on GSM8K-30 (1.10x against MARS's 1.09x), and at its
# tau in round two's GSM8K-30 (1.12x both; FLy's windows sit at 1.07x and 1.18-1.19x): kept.
MATCHED=pthresh@0.25
# The run-level theta and margin stay those the first comparison was made with, so the existing run
# folders accept the new methods and their strict/MARS/rival records are reused as they are.
COMMON=(--margin prob_ratio --theta 0.5 --threads 2)

bench() { echo "=== $(date -u +%FT%TZ) bench $*"; "$MARSPEC" bench "$@" "${COMMON[@]}"; echo "=== rc $?"; }
# Twice with --redo-contended: the second pass decodes again what the first timed under load. A machine
# whose CPU differs from the one a folder's records were made on needs strict decoded there as well
# (`--methods strict --redo-other-cpu`): a speed ratio pairs each decode with strict's on its own CPU.
step() { bench "$@" --redo-contended; bench "$@" --redo-contended; }

case "${1:-}" in
compare)
    step --task humaneval --limit 30 --methods "strict,$DEF,$RIVALS,$FLY,$GUARDED" --out $R/rivals-greedy-humaneval-30
    step --task gsm8k --limit 30 --methods "strict,$DEF,$RIVALS,$FLY,$GUARDED" --out $R/rivals-greedy-gsm8k-30
    ;;
speed-again)
    # Round two's methods were added to the folders in a later sitting than strict (and on HumanEval-30 on
    # another CPU): --redo-apart decodes strict and them again, question by question, back to back. The
    # first comparison's rules keep their records, timed with strict's older decode on their own CPU.
    for task in humaneval gsm8k; do
        bench --task $task --limit 30 --methods "strict,$FLY,$GUARDED" --out $R/rivals-greedy-$task-30 --redo-apart
        # Every method again: nothing left to decode, so this only rewrites the summary over all of them.
        bench --task $task --limit 30 --methods "strict,$DEF,$RIVALS,$FLY,$GUARDED" --out $R/rivals-greedy-$task-30
    done
    ;;
gsm8k250)
    # Questions 51-300: none of the first 50 (greedy-gsm8k-50), so the interval is on unseen questions.
    # Hours over several sittings, and a sitting's machine is not kept: the run grows in in-progress/,
    # whose records are committed at the end of each sitting (tests/test_committed_runs.py checks only
    # whole runs), and moves beside the others once whole (its summary is written only then). Once there,
    # this step decodes nothing and only rewrites its summary.
    WHOLE=$R/greedy-gsm8k-250
    PART=$R/in-progress/greedy-gsm8k-250
    ARGS=(--task gsm8k --offset 50 --limit 250 --methods "strict,$DEF,$GUARDED,$MATCHED")
    if [ -d $WHOLE ]; then
        bench "${ARGS[@]}" --out $WHOLE
    else
        step "${ARGS[@]}" --out $PART
        if [ -f $PART/summary.json ]; then mv $PART $WHOLE; fi
    fi
    ;;
tables)
    for task in humaneval gsm8k; do
        python -m marspec.eval.rules_table $R/rivals-greedy-$task-30 $R/sweep-greedy-$task-30
        "$MARSPEC" report $R/rivals-greedy-$task-30 $R/sweep-greedy-$task-30 \
            --combined $R/rivals-greedy-$task-30/pareto-with-sweep.png
    done
    python -m marspec.eval.rules_table --pooled $R/rivals-greedy-humaneval-30 $R/rivals-greedy-gsm8k-30
    # GSM8K-250 and the decision rule's measure (docs/rules.md, "How `gsm8k250` decides"); then the first
    # 300 questions pooled, with greedy-gsm8k-50's strict and MARS.
    python -m marspec.eval.rules_table $R/greedy-gsm8k-250
    python -m marspec.eval.rules_table --pooled $R/greedy-gsm8k-250
    python -m marspec.eval.rules_table --pooled $R/greedy-gsm8k-50 $R/greedy-gsm8k-250
    python benchmarks/relaxed_token_classes.py $R/greedy-humaneval-100 $R/greedy-gsm8k-50 \
        $R/rivals-greedy-humaneval-30 $R/rivals-greedy-gsm8k-30 $R/sweep-greedy-humaneval-30 \
        $R/sweep-greedy-gsm8k-30
    # Out of sample: the classes at GSM8K-250's first divergences.
    python benchmarks/relaxed_token_classes.py $R/greedy-gsm8k-250
    ;;
*)
    echo "usage: $0 compare | speed-again | gsm8k250 | tables" >&2
    exit 2
    ;;
esac
