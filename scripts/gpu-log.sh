# Sourced by the scripts that run commands on the GPU machine
# (chunked-loss-gpu.sh, gpu-8gib.sh): unpacking the CUDA builds and running
# commands into a log. The script sets WORK (where the binaries go), LOG,
# CAP (seconds per command) and DEADLINE (seconds after which no command
# starts) first.

# Unpacks BIN_DIR/NAME-cuda.xz to $WORK/NAME, for each NAME after BIN_DIR.
unpack() {
    local dir=$1 bin
    shift
    for bin in "$@"; do
        xz -dc "$dir/$bin-cuda.xz" >"$WORK/$bin" && chmod +x "$WORK/$bin" ||
            { echo "cannot unpack $dir/$bin-cuda.xz" >&2; exit 1; }
    done
}

# Runs ARGS..., appending the command line, its output and exit status to
# $LOG (paths under $WORK shortened to their names there).
logged() {
    if ((SECONDS > DEADLINE)); then
        printf '$ %s\n(skipped: deadline)\n\n' "$*" | sed "s|$WORK/||g" | tee -a "$LOG"
        return
    fi
    local start=$SECONDS
    printf '$ %s\n' "$*" | sed "s|$WORK/||g" | tee -a "$LOG"
    timeout "$CAP" "$@" 2>&1 | sed "s|$WORK/||g" | tee -a "$LOG"
    printf '(exit status %s, %d s)\n\n' "${PIPESTATUS[0]}" $((SECONDS - start)) | tee -a "$LOG"
}
