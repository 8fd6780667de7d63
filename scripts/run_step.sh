# Sourced by the GPU evidence scripts. `run NAME DEADLINE_S ARGS...` runs one product command (`$cf ARGS`) under a
# deadline, its output kept in `$out/NAME.log` with its start, end and exit status; a script that defines
# `after_run` has it called after every step (e.g. to pack what is there so far).
run() {
  local name=$1 deadline=$2; shift 2
  echo "[$(date +%T)] $cf $*" | tee "$out/$name.log"
  timeout "$deadline" $cf "$@" 2>&1 | tee -a "$out/$name.log"
  echo "[$(date +%T)] $name exit ${PIPESTATUS[0]}" | tee -a "$out/$name.log"
  if declare -F after_run > /dev/null; then after_run; fi
}
