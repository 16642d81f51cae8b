# Sourced by the multi-stage quick starts (finetune_debug.sh, grpo_debug.sh): each stage runs unless its output is
# there already, and a stage that fails, or ends without its output (a stop signal: the run saved a checkpoint and
# exited cleanly), stops the script with a sentence naming the stage and how to resume it, instead of going on to a
# stage that would fail for want of that output.
#   stage NUMBER NAME OUTPUT COMMAND...
#   last_stage NUMBER NAME COMMAND...      replaces the script (exec), so a stop signal sent to the script reaches it;
#                                          its own last lines say how it ended
STAGES_SCRIPT=${STAGES_SCRIPT:-./scripts/$(basename "$0")}

stage() {
    local number=$1 name=$2 output=$3 code=0
    shift 3
    if [ -e "$output" ]; then
        echo "stage $number ($name): done already ($output)" >&2
        return 0
    fi
    echo "stage $number ($name) ..." >&2
    "$@" || code=$?
    if [ "$code" -ne 0 ]; then
        echo "$STAGES_SCRIPT: stage $number ($name) failed (exit code $code) and the stages after it did not run;" \
            "fix what its last lines say, then rerun $STAGES_SCRIPT: the finished stages are skipped and a training" \
            "stage resumes from its last checkpoint" >&2
        exit "$code"
    fi
    if [ ! -e "$output" ]; then
        echo "$STAGES_SCRIPT: stage $number ($name) did not finish ($output is missing: it was stopped) and the" \
            "stages after it did not run; rerun $STAGES_SCRIPT to resume it (a training stage from its last" \
            "checkpoint)" >&2
        exit 1
    fi
}

last_stage() {
    echo "stage $1 ($2) ..." >&2
    shift 2
    exec "$@"
}
