# Timing helpers shared by bench/obs/*.sh (sourced, not run). The caller sets DIR, a scratch
# folder for /usr/bin/time's output and the measured command's stdout/stderr.

# The median / the largest of the numbers on stdin, one per line.
median() { sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
maximum() { sort -g | awk '{a[NR] = $1} END {print a[NR]}'; }

# timed N CMD...: runs CMD N times under /usr/bin/time. Sets WALLS (seconds per run) and RSS_KB
# (peak resident set per run, kB); CMD's stdout goes to $DIR/out.txt, stderr to $DIR/err.txt.
timed() {
  local n=$1 w m
  shift
  WALLS=() RSS_KB=()
  for _ in $(seq "$n"); do
    /usr/bin/time -f '%e %M' -o "$DIR/time.txt" "$@" > "$DIR/out.txt" 2> "$DIR/err.txt"
    read -r w m < "$DIR/time.txt"
    WALLS+=("$w") RSS_KB+=("$m")
  done
}

# measure LABEL N CMD...: timed, then one line: median wall time, all times, peak RSS (MB).
measure() {
  local label=$1 n=$2
  shift 2
  timed "$n" "$@"
  echo "$label: median $(printf '%s\n' "${WALLS[@]}" | median) s over $n runs" \
    "(all: ${WALLS[*]}), peak RSS $(($(printf '%s\n' "${RSS_KB[@]}" | maximum) / 1024)) MB"
}

# measure_json LABEL N CMD...: the same as one JSON line.
measure_json() {
  local label=$1 n=$2
  shift 2
  timed "$n" "$@"
  json_line "$label" "${WALLS[*]}" "$(printf '%s\n' "${RSS_KB[@]}" | maximum)"
}

# json_line LABEL "SECONDS..." PEAK_RSS_KB: the JSON line measure_json prints.
json_line() {
  local median_s
  median_s=$(printf '%s\n' $2 | median)
  echo "{\"measure\":\"$1\",\"median_s\":$median_s,\"all\":\"$2\",\"peak_rss_mb\":$(($3 / 1024))}"
}
