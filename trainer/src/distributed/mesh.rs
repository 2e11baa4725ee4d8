//! The process groups of one rank's device mesh ([`DeviceMesh`]): one [`Group`] per mesh
//! dimension titan-train shards over (`tp`, `dp_shard`, `dp_replicate`, `cp`, and expert
//! parallelism's `ep` and `efsdp`) and the flattened `dp` (replicate x shard) torchtitan uses
//! for token counts and metrics. The same code runs one
//! process (every group of size 1, no collective is called) and many (cpu or nccl groups).

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};

use tch::{Device, Kind, Tensor};
use titan_obs_core::Reduce;

use super::comm::{CollectiveOp, Collectives, CommError, Issued, P2pOp, QueuedWork, ReduceOp};
use super::runtime::Dist;
use crate::parallel::{Dim, Mesh, RankSync};

/// A handle on one process group, shareable with autograd functions (which run the group's
/// collectives from the backward pass). A group of one rank calls no backend at all.
///
/// Collectives run in the order they are issued on this rank, whether they block the caller or
/// run on a background thread ([`Group::all_gather_async`], FSDP's prefetch): every rank issues
/// the same sequence, so every rank's backend sees the same order.
#[derive(Clone)]
pub struct Group {
    inner: Option<Arc<Shared>>,
    rank: usize,
    size: usize,
}

struct Shared {
    group: Mutex<Box<dyn Collectives>>,
    /// The backend queues collectives on the device (NCCL): the `*_async` calls queue them
    /// from the calling thread instead of running them on the background thread.
    queues: bool,
    /// (next ticket to hand out, ticket whose turn it is).
    turn: Mutex<(u64, u64)>,
    turn_changed: Condvar,
    /// The group's background thread (started by its first background collective), fed jobs
    /// in issue order; it ends when the group is dropped.
    worker: Mutex<Option<Sender<Job>>>,
}

type Job = Box<dyn FnOnce() + Send>;

impl Shared {
    /// Runs `job` on the group's background thread, or here when no thread can be started.
    fn in_background(&self, job: Job) {
        let mut worker = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if worker.is_none() {
            let (tx, rx) = channel::<Job>();
            let started = std::thread::Builder::new()
                .name("titan-comm".into())
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                });
            if started.is_ok() {
                *worker = Some(tx);
            }
        }
        match worker.as_ref() {
            Some(tx) => {
                if let Err(returned) = tx.send(job) {
                    returned.0();
                }
            }
            None => job(),
        }
    }

    fn ticket(&self) -> u64 {
        let mut t = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        t.0 += 1;
        t.0 - 1
    }

    /// Runs `f` on the backend once every earlier ticket has run.
    fn run<T>(
        &self,
        ticket: u64,
        f: impl FnOnce(&mut dyn Collectives) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let mut t = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        while t.1 != ticket {
            t = self.turn_changed.wait(t).unwrap_or_else(|e| e.into_inner());
        }
        drop(t);
        let result = {
            let mut g = self.group.lock().unwrap_or_else(|e| e.into_inner());
            f(g.as_mut())
        };
        let mut t = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        t.1 += 1;
        self.turn_changed.notify_all();
        result
    }
}

/// A collective issued without waiting for it: on the group's background thread (the `cpu`
/// backend), or queued on the device (NCCL, [`QueuedWork`]). [`Pending::wait`] returns its
/// result; the tensors it was given stay alive until then (or until it is dropped, which waits).
pub struct Pending(Waiting);

enum Waiting {
    /// Ran already (a group of one rank, or an error before anything ran).
    Now(Option<Result<(), CommError>>),
    /// On the group's background thread.
    Background(Receiver<Result<(), CommError>>),
    /// On the device, in issue order (a chained collective last). Declared before the tensors:
    /// a dropped `Pending` makes the default stream wait before their memory can be reused.
    Queued {
        works: Vec<Box<dyn QueuedWork>>,
        _tensors: Vec<Tensor>,
    },
}

fn thread_ended() -> CommError {
    CommError::BadArgument {
        op: "prefetch",
        message: "the background collective's thread ended without a result".into(),
    }
}

impl Pending {
    fn now(result: Result<(), CommError>) -> Self {
        Pending(Waiting::Now(Some(result)))
    }

    /// What the device still runs of `issued`, holding `tensors` until it is waited for.
    fn issued(issued: Vec<Issued>, tensors: Vec<Tensor>) -> Self {
        let works: Vec<Box<dyn QueuedWork>> = issued
            .into_iter()
            .filter_map(|i| match i {
                Issued::Queued(w) => Some(w),
                Issued::Done => None,
            })
            .collect();
        if works.is_empty() {
            return Pending::now(Ok(()));
        }
        Pending(Waiting::Queued {
            works,
            _tensors: tensors,
        })
    }

    /// The result if the collective has finished (`Some`), without waiting.
    pub fn try_result(&mut self) -> Option<Result<(), CommError>> {
        match &mut self.0 {
            Waiting::Now(r) => Some(r.take().unwrap_or(Ok(()))),
            Waiting::Background(rx) => match rx.try_recv() {
                Ok(result) => Some(result),
                Err(std::sync::mpsc::TryRecvError::Empty) => None,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => Some(Err(thread_ended())),
            },
            Waiting::Queued { works, .. } => {
                for w in works.iter() {
                    match w.is_done() {
                        Ok(true) => {}
                        Ok(false) => return None,
                        Err(e) => return Some(Err(e)),
                    }
                }
                Some(Ok(()))
            }
        }
    }

    /// Its result: on the host for a background collective; for a queued one, once the default
    /// stream waits for it (the host does not).
    pub fn wait(self) -> Result<(), CommError> {
        match self.0 {
            Waiting::Now(r) => r.unwrap_or(Ok(())),
            Waiting::Background(rx) => rx.recv().unwrap_or_else(|_| Err(thread_ended())),
            Waiting::Queued { mut works, .. } => {
                for w in works.iter_mut() {
                    w.wait()?;
                }
                Ok(())
            }
        }
    }
}

impl Group {
    /// The group of this rank alone.
    pub fn solo() -> Self {
        Group {
            inner: None,
            rank: 0,
            size: 1,
        }
    }

    pub(crate) fn new(group: Box<dyn Collectives>) -> Self {
        let (rank, size) = (group.rank(), group.size());
        Group {
            inner: (size > 1).then(|| {
                Arc::new(Shared {
                    queues: group.queues_on_device(),
                    group: Mutex::new(group),
                    turn: Mutex::new((0, 0)),
                    turn_changed: Condvar::new(),
                    worker: Mutex::new(None),
                })
            }),
            rank,
            size,
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut dyn Collectives) -> Result<T, CommError>,
    ) -> Option<Result<T, CommError>> {
        let inner = self.inner.as_ref()?;
        Some(inner.run(inner.ticket(), f))
    }

    /// Runs `job` on the group's background thread once the collectives issued before it on
    /// this rank have run (`job` gets this group's ticket-ordered runner).
    fn in_background(
        inner: &Arc<Shared>,
        job: impl FnOnce(&Shared, u64) -> Result<(), CommError> + Send + 'static,
    ) -> Pending {
        let ticket = inner.ticket();
        let (tx, rx) = channel();
        let shared = inner.clone();
        inner.in_background(Box::new(move || {
            let _ = tx.send(job(&shared, ticket));
        }));
        Pending(Waiting::Background(rx))
    }

    /// Queues `op` on the device from this thread, in issue order, keeping `tensors` alive
    /// until it is waited for.
    fn queued(inner: &Shared, op: CollectiveOp<'_>, tensors: Vec<Tensor>) -> Pending {
        match inner.run(inner.ticket(), |g| g.queue(op, None)) {
            Ok(issued) => Pending::issued(vec![issued], tensors),
            Err(e) => Pending::now(Err(e)),
        }
    }

    /// [`Group::reduce_scatter`] (sum) of `input` into `output` on a background thread, then,
    /// when `then` is given, a sum all-reduce of `output` over that group, each after the
    /// collectives issued before it on its group. The tensors must stay untouched until
    /// [`Pending::wait`] returns.
    pub fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        then: Option<&Group>,
    ) -> Pending {
        let second = then
            .and_then(|g| g.inner.clone())
            .map(|inner| (inner.ticket(), inner));
        let Some(inner) = &self.inner else {
            let result = self
                .reduce_scatter(output, input)
                .and_then(|()| match &second {
                    Some((ticket, g)) => g.run(*ticket, |c| c.all_reduce(output, ReduceOp::Sum)),
                    None => Ok(()),
                });
            return Pending::now(result);
        };
        if inner.queues {
            // Both on the device, the replicas' all-reduce behind the reduce-scatter.
            let scatter = CollectiveOp::ReduceScatter {
                output,
                input,
                op: ReduceOp::Sum,
            };
            let tensors = vec![output.shallow_clone(), input.shallow_clone()];
            let first = match inner.run(inner.ticket(), |g| g.queue(scatter, None)) {
                Ok(issued) => issued,
                Err(e) => return Pending::now(Err(e)),
            };
            let Some((ticket, g)) = &second else {
                return Pending::issued(vec![first], tensors);
            };
            let reduce = CollectiveOp::AllReduce {
                tensor: output,
                op: ReduceOp::Sum,
            };
            let after = match &first {
                Issued::Queued(w) => Some(w.as_ref()),
                Issued::Done => None,
            };
            return match g.run(*ticket, |c| c.queue(reduce, after)) {
                Ok(issued) => Pending::issued(vec![first, issued], tensors),
                Err(e) => Pending::now(Err(e)),
            };
        }
        let (output, input) = (output.shallow_clone(), input.shallow_clone());
        Self::in_background(inner, move |shared, ticket| {
            shared
                .run(ticket, |g| g.reduce_scatter(&output, &input, ReduceOp::Sum))
                .and_then(|()| match &second {
                    Some((ticket, g)) => g.run(*ticket, |c| c.all_reduce(&output, ReduceOp::Sum)),
                    None => Ok(()),
                })
        })
    }

    /// [`Group::all_reduce`] (in place) on a background thread, or queued on the device, after
    /// the collectives issued before it: DDP's gradient buckets. The tensor must stay untouched
    /// until [`Pending::wait`] returns.
    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Pending {
        let Some(inner) = &self.inner else {
            return Pending::now(Ok(()));
        };
        if inner.queues {
            let all_reduce = CollectiveOp::AllReduce { tensor: t, op };
            return Self::queued(inner, all_reduce, vec![t.shallow_clone()]);
        }
        let t = t.shallow_clone();
        Self::in_background(inner, move |shared, ticket| {
            shared.run(ticket, |g| g.all_reduce(&t, op))
        })
    }

    /// [`Group::all_gather`] on a background thread, after the collectives issued before it.
    /// The tensors must stay untouched until [`Pending::wait`] returns.
    pub fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Pending {
        let Some(inner) = &self.inner else {
            output.shallow_clone().copy_(&input.reshape_as(output));
            return Pending::now(Ok(()));
        };
        if inner.queues {
            let tensors = vec![output.shallow_clone(), input.shallow_clone()];
            return Self::queued(inner, CollectiveOp::AllGather { output, input }, tensors);
        }
        let (output, input) = (output.shallow_clone(), input.shallow_clone());
        Self::in_background(inner, move |shared, ticket| {
            shared.run(ticket, |g| g.all_gather(&output, &input))
        })
    }

    /// [`Collectives::send_recv`] (torch's `batch_isend_irecv`) on a background thread, or
    /// queued on the device, after the collectives issued before it: the pipeline's transfers.
    /// The tensors must stay untouched (a receive's unread) until [`Pending::wait`] returns.
    pub fn send_recv_async(&self, ops: &[P2pOp<'_>]) -> Pending {
        let Some(inner) = &self.inner else {
            return Pending::now(Err(CommError::BadArgument {
                op: "batch_isend_irecv",
                message: "a group of one rank has no peer to send to".into(),
            }));
        };
        let tensors: Vec<Tensor> = ops.iter().map(|op| op.tensor().shallow_clone()).collect();
        if inner.queues {
            return Self::queued(inner, CollectiveOp::SendRecv { ops }, tensors);
        }
        // The background thread's own handles on the same tensors.
        let owned: Vec<(Tensor, usize, bool)> = ops
            .iter()
            .zip(tensors)
            .map(|(op, t)| (t, op.peer(), op.is_send()))
            .collect();
        Self::in_background(inner, move |shared, ticket| {
            let batch: Vec<P2pOp<'_>> = owned
                .iter()
                .map(|(tensor, peer, send)| match send {
                    true => P2pOp::Send {
                        tensor,
                        peer: *peer,
                    },
                    false => P2pOp::Recv {
                        tensor,
                        peer: *peer,
                    },
                })
                .collect();
            shared.run(ticket, |g| g.send_recv(&batch))
        })
    }

    /// In place on every rank.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.with(|g| g.all_reduce(t, op)).unwrap_or(Ok(()))
    }

    /// `output` (size x input elements) gets every rank's `input` in rank order.
    pub fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        match self.with(|g| g.all_gather(output, input)) {
            Some(r) => r,
            None => {
                output.shallow_clone().copy_(&input.reshape_as(output));
                Ok(())
            }
        }
    }

    /// Rank r's `output` gets the reduction of chunk r of everyone's `input`.
    pub fn reduce_scatter(&self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        match self.with(|g| g.reduce_scatter(output, input, ReduceOp::Sum)) {
            Some(r) => r,
            None => {
                output.shallow_clone().copy_(&input.reshape_as(output));
                Ok(())
            }
        }
    }

    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<(), CommError> {
        self.with(|g| g.broadcast(t, root)).unwrap_or(Ok(()))
    }

    /// torch's `all_to_all_single` with splits ([`Collectives::all_to_all`]); alone, `output`
    /// gets `input`.
    pub fn all_to_all(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        match self.with(|g| g.all_to_all(output, input, output_splits, input_splits)) {
            Some(r) => r,
            None => {
                output.shallow_clone().copy_(input);
                Ok(())
            }
        }
    }

    pub fn barrier(&self) -> Result<(), CommError> {
        self.with(|g| g.barrier()).unwrap_or(Ok(()))
    }

    /// The backend's device for small host values (scalars must be CUDA tensors for nccl).
    fn scalar_device(&self, cuda_index: usize) -> Device {
        match self.with(|g| Ok(g.backend())) {
            Some(Ok("nccl")) => Device::Cuda(cuda_index),
            _ => Device::Cpu,
        }
    }
}

/// This rank's mesh and its groups.
pub struct DeviceMesh {
    pub mesh: Mesh,
    pub tp: Group,
    /// The ranks holding the pipeline stages of the same data and tensor slices.
    pub pp: Group,
    pub dp_shard: Group,
    pub dp_replicate: Group,
    /// dp_replicate x dp_shard flattened: the ranks that read different data.
    pub dp: Group,
    /// The ranks holding the parts of one sequence (context parallelism).
    pub cp: Group,
    /// dp_shard x cp flattened: the ranks FSDP shards over (torchtitan's `fsdp` mesh).
    pub fsdp: Group,
    /// dp x cp flattened: the ranks whose losses (and MoE token counts) add up to the step's
    /// (torchtitan's `loss` mesh).
    pub dp_cp: Group,
    /// The ranks routed experts are split over, exchanging tokens (expert parallelism).
    pub ep: Group,
    /// The ranks FSDP shards the routed experts over under expert parallelism
    /// (`dp_shard x cp x tp / ep`); without it, `fsdp`.
    pub efsdp: Group,
    scalar_device: Device,
    dist: Option<Dist>,
}

impl DeviceMesh {
    /// One process: every group is this rank alone.
    pub fn single() -> Self {
        DeviceMesh {
            mesh: Mesh::single(),
            tp: Group::solo(),
            pp: Group::solo(),
            dp_shard: Group::solo(),
            dp_replicate: Group::solo(),
            dp: Group::solo(),
            cp: Group::solo(),
            fsdp: Group::solo(),
            dp_cp: Group::solo(),
            ep: Group::solo(),
            efsdp: Group::solo(),
            scalar_device: Device::Cpu,
            dist: None,
        }
    }

    /// Creates the groups of `mesh` over the joined job `dist` (every rank calls this with the
    /// same mesh degrees). Without context parallelism `fsdp` is `dp_shard` and `dp_cp` is
    /// `dp` (no second communicator over the same ranks). The pipeline's point-to-point groups
    /// are made by the pipeline ([`DeviceMesh::new_group`]).
    pub fn connect(dist: Dist, mesh: Mesh) -> Result<Self, CommError> {
        let named = |members: Vec<usize>, tag: &str| -> Result<Group, CommError> {
            if members.len() == 1 {
                return Ok(Group::solo());
            }
            let name = format!("{tag}/{}", members[0]);
            Ok(Group::new(dist.new_group(&name, members)?))
        };
        let group = |dims: &[Dim], tag: &str| named(mesh.group_members(dims), tag);
        let tp = group(&[Dim::Tp], "tp")?;
        let pp = group(&[Dim::Pp], "pp")?;
        let dp_shard = group(&[Dim::DpShard], "dp_shard")?;
        let dp_replicate = group(&[Dim::DpReplicate], "dp_replicate")?;
        let dp = group(&[Dim::DpReplicate, Dim::DpShard], "dp")?;
        let (cp, fsdp, dp_cp) = if mesh.cp > 1 {
            (
                group(&[Dim::Cp], "cp")?,
                group(&[Dim::DpShard, Dim::Cp], "fsdp")?,
                group(&[Dim::DpReplicate, Dim::DpShard, Dim::Cp], "dp_cp")?,
            )
        } else {
            (Group::solo(), dp_shard.clone(), dp.clone())
        };
        let (ep, efsdp) = if mesh.ep > 1 {
            (
                named(mesh.ep_members(), "ep")?,
                named(mesh.efsdp_members(), "efsdp")?,
            )
        } else {
            (Group::solo(), fsdp.clone())
        };
        let scalar_device = [&tp, &dp, &pp, &cp]
            .iter()
            .map(|g| g.scalar_device(dist.device_index))
            .find(|d| d.is_cuda())
            .unwrap_or(Device::Cpu);
        Ok(DeviceMesh {
            mesh,
            tp,
            pp,
            dp_shard,
            dp_replicate,
            dp,
            cp,
            fsdp,
            dp_cp,
            ep,
            efsdp,
            scalar_device,
            dist: Some(dist),
        })
    }

    /// A process group of `members` (global ranks, ascending) named `tag`: every member calls
    /// this, in the same order as the other groups it shares with them.
    pub fn new_group(&self, tag: &str, members: Vec<usize>) -> Result<Group, CommError> {
        let dist = match &self.dist {
            Some(dist) if members.len() > 1 => dist,
            _ => return Ok(Group::solo()),
        };
        let name = format!(
            "{tag}/{}",
            members
                .iter()
                .map(|m| m.to_string())
                .collect::<Vec<_>>()
                .join("-")
        );
        Ok(Group::new(dist.new_group(&name, members)?))
    }

    pub fn dist(&self) -> Option<&Dist> {
        self.dist.as_ref()
    }

    /// How ranks meet to commit a checkpoint (None: one process).
    pub fn rank_sync(&self) -> Option<Arc<dyn RankSync>> {
        self.dist.as_ref()?.store_barrier()
    }

    /// Reduces `values` (f64) over `group` with `op`.
    pub fn reduce_scalars(
        &self,
        group: &Group,
        values: &[f64],
        op: ReduceOp,
    ) -> Result<Vec<f64>, CommError> {
        if group.size() == 1 {
            return Ok(values.to_vec());
        }
        let t = Tensor::from_slice(values)
            .to_kind(Kind::Double)
            .to_device(self.scalar_device);
        group.all_reduce(&t, op)?;
        // A read to the host (a sync on a GPU): counted, and made only on steps that log.
        Ok(crate::host_sync::read_f64s(&t, "reduce_scalars"))
    }

    /// Makes every rank use rank 0's `seed` (a seed drawn from the clock differs per rank; the
    /// model is initialised from the same stream everywhere and each rank keeps its part).
    pub fn agree_seed(&self, seed: u64) -> Result<u64, CommError> {
        let t = Tensor::from_slice(&[seed as i64]).to_device(self.scalar_device);
        for g in [&self.dp, &self.tp, &self.pp, &self.cp] {
            if g.size() > 1 {
                g.broadcast(&t, 0)?;
            }
        }
        Ok(t.int64_value(&[0]) as u64)
    }

    /// Valid label tokens of this step summed over the data-parallel ranks: the loss
    /// denominator.
    pub fn global_valid_tokens(&self, local: i64) -> Result<i64, CommError> {
        let sum = self.reduce_scalars(&self.dp, &[local as f64], ReduceOp::Sum)?;
        Ok(sum[0].round() as i64)
    }

    /// Reduces each metric in place with its reduction: a sum over the data- and
    /// context-parallel ranks (the loss, whose model-parallel ranks hold the same value; each
    /// context-parallel rank holds its tokens' part), a mean, max or min over
    /// every rank of the job — the ranks `titan-obs metrics` reduces the recorded scalars
    /// over, so the console, `metrics.jsonl`, TensorBoard and titan-obs show one number
    /// (before, the console's `tps_mean` was rank 0's data-parallel group's only).
    pub fn reduce_metrics(&self, metrics: &mut [(f64, Reduce)]) -> Result<(), CommError> {
        let n = (self.mesh.dp_degree() * self.mesh.cp * self.mesh.tp * self.mesh.pp) as f64;
        let sums: Vec<f64> = metrics
            .iter()
            .map(|&(v, r)| match r {
                Reduce::Mean | Reduce::Sum => v,
                _ => 0.0,
            })
            .collect();
        let maxes: Vec<f64> = metrics
            .iter()
            .map(|&(v, r)| match r {
                Reduce::Max => v,
                Reduce::Min => -v,
                _ => f64::MIN,
            })
            .collect();
        let sums = self.reduce_scalars(&self.dp_cp, &sums, ReduceOp::Sum)?;
        // The means' sums go on over the model-parallel groups (dp x cp x tp x pp is the
        // world); the loss's does not.
        let means: Vec<f64> = metrics
            .iter()
            .zip(&sums)
            .map(|(&(_, r), &s)| if r == Reduce::Mean { s } else { 0.0 })
            .collect();
        let means = self.reduce_scalars(&self.tp, &means, ReduceOp::Sum)?;
        let means = self.reduce_scalars(&self.pp, &means, ReduceOp::Sum)?;
        let mut maxes = self.reduce_scalars(&self.dp_cp, &maxes, ReduceOp::Max)?;
        for g in [&self.tp, &self.pp] {
            maxes = self.reduce_scalars(g, &maxes, ReduceOp::Max)?;
        }
        for (i, (v, r)) in metrics.iter_mut().enumerate() {
            *v = match r {
                Reduce::Mean => means[i] / n,
                Reduce::Sum => sums[i],
                Reduce::Max => maxes[i],
                Reduce::Min => -maxes[i],
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend that queues on a pretend device: its work is done when the test says, and
    /// every call lands in `log`.
    struct Queueing {
        log: Arc<Mutex<Vec<String>>>,
        done: Arc<std::sync::atomic::AtomicBool>,
        next: usize,
    }

    struct Work {
        id: usize,
        log: Arc<Mutex<Vec<String>>>,
        done: Arc<std::sync::atomic::AtomicBool>,
        waited: bool,
    }

    impl QueuedWork for Work {
        fn wait(&mut self) -> Result<(), CommError> {
            if !self.waited {
                self.waited = true;
                self.log.lock().unwrap().push(format!("wait {}", self.id));
            }
            Ok(())
        }
        fn is_done(&self) -> Result<bool, CommError> {
            Ok(self.done.load(std::sync::atomic::Ordering::Relaxed))
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    impl Drop for Work {
        fn drop(&mut self) {
            let _ = self.wait();
        }
    }

    impl Collectives for Queueing {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            2
        }
        fn backend(&self) -> &'static str {
            "fake"
        }
        fn all_reduce(&mut self, _: &Tensor, _: ReduceOp) -> Result<(), CommError> {
            self.log.lock().unwrap().push("blocking all_reduce".into());
            Ok(())
        }
        fn reduce_scatter(&mut self, _: &Tensor, _: &Tensor, _: ReduceOp) -> Result<(), CommError> {
            self.log
                .lock()
                .unwrap()
                .push("blocking reduce_scatter".into());
            Ok(())
        }
        fn all_gather(&mut self, _: &Tensor, _: &Tensor) -> Result<(), CommError> {
            self.log.lock().unwrap().push("blocking all_gather".into());
            Ok(())
        }
        fn broadcast(&mut self, _: &Tensor, _: usize) -> Result<(), CommError> {
            self.log.lock().unwrap().push("blocking broadcast".into());
            Ok(())
        }
        fn all_to_all(
            &mut self,
            _: &Tensor,
            _: &Tensor,
            _: &[usize],
            _: &[usize],
        ) -> Result<(), CommError> {
            self.log.lock().unwrap().push("blocking all_to_all".into());
            Ok(())
        }
        fn send_recv(&mut self, _: &[P2pOp<'_>]) -> Result<(), CommError> {
            self.log.lock().unwrap().push("blocking send_recv".into());
            Ok(())
        }
        fn barrier(&mut self) -> Result<(), CommError> {
            Ok(())
        }
        fn queues_on_device(&self) -> bool {
            true
        }
        fn queue(
            &mut self,
            op: CollectiveOp<'_>,
            after: Option<&dyn QueuedWork>,
        ) -> Result<Issued, CommError> {
            self.next += 1;
            let after = after.map(|w| w.as_any().downcast_ref::<Work>().unwrap().id);
            self.log.lock().unwrap().push(format!(
                "queue {} {} after {after:?} on {:?}",
                op.name(),
                self.next,
                std::thread::current().name()
            ));
            Ok(Issued::Queued(Box::new(Work {
                id: self.next,
                log: self.log.clone(),
                done: self.done.clone(),
                waited: false,
            })))
        }
    }

    fn queueing(log: &Arc<Mutex<Vec<String>>>, done: &Arc<std::sync::atomic::AtomicBool>) -> Group {
        Group::new(Box::new(Queueing {
            log: log.clone(),
            done: done.clone(),
            next: 0,
        }))
    }

    /// On a backend that queues on the device (NCCL) the async collectives are queued from the
    /// calling thread, in issue order, a chained reduction behind the one it reads; nothing
    /// waits until the caller does (a dropped one waits too).
    #[test]
    fn queued_collectives_wait_only_when_asked() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (shard, replicas) = (queueing(&log, &done), queueing(&log, &done));
        let t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let big = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        let me = std::thread::current().name().map(str::to_string);

        let mut gather = shard.all_gather_async(&big, &t);
        assert_eq!(
            *log.lock().unwrap(),
            [format!("queue all_gather 1 after None on {me:?}")]
        );
        assert!(gather.try_result().is_none(), "not done on the device yet");
        let reduce = shard.reduce_scatter_async(&t, &big, Some(&replicas));
        assert_eq!(
            log.lock().unwrap()[1..],
            [
                format!("queue reduce_scatter 2 after None on {me:?}"),
                format!("queue all_reduce 1 after Some(2) on {me:?}"),
            ]
        );
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(matches!(gather.try_result(), Some(Ok(()))));
        gather.wait().unwrap();
        assert_eq!(log.lock().unwrap().last().unwrap(), "wait 1");
        // Dropped unwaited: the device's streams are still ordered behind it.
        drop(reduce);
        assert_eq!(log.lock().unwrap()[4..], ["wait 2", "wait 1"]);
        // The blocking calls stay blocking.
        shard.all_reduce(&t, ReduceOp::Sum).unwrap();
        assert_eq!(log.lock().unwrap().last().unwrap(), "blocking all_reduce");
        // A pipeline's batch of transfers is queued as one call, from this thread.
        let received = big.copy();
        let batch = shard.send_recv_async(&[
            P2pOp::Send {
                tensor: &t,
                peer: 1,
            },
            P2pOp::Recv {
                tensor: &received,
                peer: 1,
            },
        ]);
        assert_eq!(
            log.lock().unwrap().last().unwrap(),
            &format!("queue batch_isend_irecv 3 after None on {me:?}")
        );
        batch.wait().unwrap();
        assert_eq!(log.lock().unwrap().last().unwrap(), "wait 3");
    }
}
