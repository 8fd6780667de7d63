# Sourced by the GPU evidence scripts: `step NAME DEADLINE CMD...` runs CMD with its output in $work/NAME.log, under
# a deadline, prints its last lines, and marks it done ($work/NAME.done) when it exits 0, so a second call on the
# same WORK folder does not run it again; SKIP="NAME ..." leaves steps out. After each step it calls the sourcing
# script's `keep` (the raw files tarred into the call's output).
step() { local name=$1 deadline=$2; shift 2; [ -f "$work/$name.done" ] && { echo "$name: done before"; return; }
  case " ${SKIP:-} " in *" $name "*) echo "$name: skipped (SKIP)"; return;; esac
  echo "[$(date +%T)] $*" | tee "$work/$name.log"
  timeout "$deadline" "$@" >>"$work/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$work/$name.log"
  tail -2 "$work/$name.log" | cut -c1-300; [ $rc = 0 ] && touch "$work/$name.done"; keep; }
