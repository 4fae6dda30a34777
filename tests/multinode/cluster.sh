# A simulated slurm cluster of several nodes on one machine, for `make test-multinode` and
# `make test-journey` (CLUSTER_TEST names the test in its messages).
# Source it, then:
#
#   cluster_up N      N nodes; each is a Linux network namespace with an address of its own on a
#                     private bridge (veth pairs; 10.231.0.0/24, used only inside these
#                     namespaces), its own hostname (a UTS namespace: node1, node2, ...) and its
#                     own slurmd; slurmctld runs on node1, munged serves them all
#   on_node K CMD...  run CMD on node K (its network, its hostname)
#   cluster_down      stop every daemon by its pid file and delete the namespaces, by the names
#                     this shell created (run by the EXIT trap that cluster_up sets); unmount what
#                     was mounted under $CLUSTER_DIR
#   link_down K / link_up K   node K's interface to the others set down / up (its cable pulled)
#   link_slow K RATE  node K's link both ways at RATE (tc's token bucket, e.g. 4mbit); link_up clears it
#   small_disk DIR SIZE   a filesystem of SIZE (tmpfs) mounted at DIR, for a disk that fills up
#
# Nothing listens outside the namespaces: the bridge lives in a namespace of its own, the root
# namespace gets no address and no route. Needs root (namespaces, daemons); without root,
# cluster_up says so and returns 2. Daemons' logs and state are under $CLUSTER_DIR.

CLUSTER_ID=${CLUSTER_ID:-mrl$$}
CLUSTER_NET=${CLUSTER_NET:-10.231.0}
CLUSTER_NODES=0
CLUSTER_DIR=""

_cluster_log() { echo "[cluster $(date +%H:%M:%S)] $*" >&2; }

node_ns() { echo "$CLUSTER_ID-n$1"; }
node_addr() { echo "$CLUSTER_NET.$1"; }

# run CMD on node K: in its network namespace, with its hostname, its /etc/hosts and shared
# memory of its own (each call enters a UTS, an IPC and a mount namespace of its own, given the
# node's name, hosts file and an empty /dev/shm; the processes started there keep them: slurmd's
# jobs share its node's). Nodes share no /dev/shm, as real ones do not: a program that tells its
# peers on the same node by a shared-memory segment they can open (SGLang does) must see the
# other node as another. Not `ip netns exec`: it remounts /sys, and slurmd needs the cgroup
# filesystem under it.
on_node() {
    local k=$1; shift
    nsenter --net="/run/netns/$(node_ns "$k")" unshare --uts --ipc --mount --propagation private -- \
        sh -c 'mount --bind "$1" /etc/hosts && mount -t tmpfs -o mode=1777 tmpfs /dev/shm &&
               hostname "$0" && shift && exec "$@"' \
        "node$k" "$CLUSTER_DIR/hosts" "$@"
}

_cluster_free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

cluster_up() {
    local n=$1 k
    if [[ $(id -u) -ne 0 ]]; then
        echo "${CLUSTER_TEST:-test-multinode}: needs root (network namespaces, slurm daemons); run it as root" >&2
        return 2
    fi
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        _cluster_log "installing slurm-wlm and munge (Debian packages)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; }
    fi
    CLUSTER_DIR=$(mktemp -d "/tmp/megarl-cluster.XXXXXX")
    mkdir -p "$CLUSTER_DIR/state" "$CLUSTER_DIR/log"
    trap cluster_down EXIT

    # the network: a bridge in a hub namespace, one veth pair per node
    ip netns add "$CLUSTER_ID-hub"
    ip -n "$CLUSTER_ID-hub" link add br0 type bridge
    ip -n "$CLUSTER_ID-hub" link set br0 up
    ip -n "$CLUSTER_ID-hub" link set lo up
    for k in $(seq "$n"); do
        ip netns add "$(node_ns "$k")"
        CLUSTER_NODES=$k
        ip link add "$CLUSTER_ID-v$k" type veth peer name "$CLUSTER_ID-h$k"
        ip link set "$CLUSTER_ID-v$k" netns "$(node_ns "$k")"
        ip link set "$CLUSTER_ID-h$k" netns "$CLUSTER_ID-hub"
        ip -n "$CLUSTER_ID-hub" link set "$CLUSTER_ID-h$k" master br0 up
        ip -n "$(node_ns "$k")" link set "$CLUSTER_ID-v$k" name eth0
        ip -n "$(node_ns "$k")" addr add "$(node_addr "$k")/24" dev eth0
        ip -n "$(node_ns "$k")" link set eth0 up
        ip -n "$(node_ns "$k")" link set lo up
        # a default route into the private network: software that finds its address by
        # routing towards a public one (Ray does) gets the node's address; nothing answers
        ip -n "$(node_ns "$k")" route add default via "$CLUSTER_NET.254" dev eth0
    done
    # the nodes' names resolve inside them (on_node mounts this over /etc/hosts)
    {
        echo "127.0.0.1 localhost"
        for k in $(seq "$n"); do echo "$(node_addr "$k") node$k"; done
    } > "$CLUSTER_DIR/hosts"

    # munge (a unix socket: shared by every namespace) and slurm
    dd if=/dev/urandom bs=1024 count=1 of="$CLUSTER_DIR/munge.key" 2>/dev/null
    chmod 600 "$CLUSTER_DIR/munge.key"
    munged --force --key-file="$CLUSTER_DIR/munge.key" --socket="$CLUSTER_DIR/munge.socket" \
        --pid-file="$CLUSTER_DIR/munged.pid" --log-file="$CLUSTER_DIR/log/munged.log" \
        --seed-file="$CLUSTER_DIR/munge.seed"
    local cpus mem_mb
    cpus=$(nproc)
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / n - 512 ))
    {
        cat <<CONF
ClusterName=megarlsim
SlurmctldHost=node1($(node_addr 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$CLUSTER_DIR/munge.socket,cred_expire=10
SchedulerParameters=sched_interval=2,bf_interval=2
CredType=cred/munge
StateSaveLocation=$CLUSTER_DIR/state
SlurmdSpoolDir=$CLUSTER_DIR/spool-%n
SlurmctldPidFile=$CLUSTER_DIR/slurmctld.pid
SlurmdPidFile=$CLUSTER_DIR/slurmd-%n.pid
SlurmctldLogFile=$CLUSTER_DIR/log/slurmctld.log
SlurmdLogFile=$CLUSTER_DIR/log/slurmd-%n.log
SlurmctldPort=$(_cluster_free_port)
SlurmdPort=$(_cluster_free_port)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=10
CONF
        for k in $(seq "$n"); do
            echo "NodeName=node$k NodeHostname=node$k NodeAddr=$(node_addr "$k") CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
        done
        # a job in `urgent` preempts those of `sim` it needs the nodes of, as on a shared cluster:
        # their steps get SIGTERM at once, the batch shell GraceTime seconds later (then SIGKILL
        # after KillWait), and they are requeued
        echo "PreemptType=preempt/partition_prio"
        echo "PreemptMode=REQUEUE"
        # a day at most, as many clusters' partitions allow (the recipes ask for 24 hours)
        echo "PartitionName=sim Nodes=ALL Default=YES MaxTime=1-00:00:00 State=UP OverSubscribe=YES PriorityTier=1 GraceTime=30"
        echo "PartitionName=urgent Nodes=ALL MaxTime=60 State=UP PriorityTier=2 PreemptMode=OFF"
    } > "$CLUSTER_DIR/slurm.conf"
    export SLURM_CONF=$CLUSTER_DIR/slurm.conf
    on_node 1 slurmctld -f "$SLURM_CONF"
    for k in $(seq "$n"); do
        mkdir -p "$CLUSTER_DIR/spool-node$k"
        on_node "$k" slurmd -f "$SLURM_CONF" -N "node$k"
    done
    local idle=0
    for _ in $(seq 60); do
        idle=$(on_node 1 sinfo -h -N -p sim -o %t 2>/dev/null | grep -c idle || true)
        (( idle == n )) && break
        sleep 1
    done
    if (( idle != n )); then
        _cluster_log "only $idle of $n nodes came up"
        return 1
    fi
    _cluster_log "$n-node slurm cluster up: $(on_node 1 sinfo -h -N -p sim -o '%N %t' | tr '\n' ' ')"
}

link_down() { ip -n "$(node_ns "$1")" link set eth0 down; }
link_up() {
    tc -n "$(node_ns "$1")" qdisc del dev eth0 root 2>/dev/null || true
    tc -n "$CLUSTER_ID-hub" qdisc del dev "$CLUSTER_ID-h$1" root 2>/dev/null || true
    ip -n "$(node_ns "$1")" link set eth0 up
}
link_slow() {
    tc -n "$(node_ns "$1")" qdisc replace dev eth0 root tbf rate "$2" burst 32kb latency 2s
    tc -n "$CLUSTER_ID-hub" qdisc replace dev "$CLUSTER_ID-h$1" root tbf rate "$2" burst 32kb latency 2s
}
small_disk() { mkdir -p "$1" && mount -t tmpfs -o "size=$2" tmpfs "$1"; }

cluster_down() {
    local status=$? k pidfile
    trap - EXIT
    if [[ -n "$CLUSTER_DIR" ]]; then
        for pidfile in "$CLUSTER_DIR"/slurmd-*.pid "$CLUSTER_DIR/slurmctld.pid" "$CLUSTER_DIR/munged.pid"; do
            [[ -f "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null
        done
        sleep 1
    fi
    # whatever is left in a node's namespace (job steps, Ray) goes with it
    for k in $(seq "$CLUSTER_NODES"); do
        local pids
        pids=$(ip netns pids "$(node_ns "$k")" 2>/dev/null || true)
        [[ -n "$pids" ]] && kill -9 $pids 2>/dev/null
        ip netns del "$(node_ns "$k")" 2>/dev/null
    done
    ip netns del "$CLUSTER_ID-hub" 2>/dev/null
    if [[ $status -ne 0 && -n "$CLUSTER_DIR" ]]; then
        echo "${CLUSTER_TEST:-test-multinode}: FAILED; the ends of the daemons' logs:" >&2
        for f in "$CLUSTER_DIR"/log/*.log; do
            [[ -f "$f" ]] && { echo "--- $f" >&2; tail -n 30 "$f" >&2; }
        done
    fi
    if [[ -n "$CLUSTER_DIR" ]]; then
        awk -v d="$CLUSTER_DIR/" 'index($2, d) == 1 {print $2}' /proc/mounts | xargs -r umount
    fi
    [[ -n "$CLUSTER_DIR" && -z "${KEEP_CLUSTER_DIR:-}" ]] && rm -rf "$CLUSTER_DIR"
    return $status
}
