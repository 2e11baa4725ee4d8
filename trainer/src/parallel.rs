//! Where this process sits in the job: the device mesh `[pp, dp_replicate, dp_shard, cp, tp]`
//! resolved with torchtitan's `ParallelDims` rule ([`Mesh`]), and the meeting points of work done
//! outside collectives ([`RankSync`]). The process groups of each mesh dimension are built from it
//! in [`crate::distributed::DeviceMesh`]; how the model is split over them is [`crate::parallelize`].

use anyhow::{Result, bail};

use crate::config::Parallelism;

/// A mesh dimension (torchtitan's names, outermost first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Pp,
    DpReplicate,
    DpShard,
    Cp,
    Tp,
}

impl Dim {
    pub const ALL: [Dim; 5] = [Dim::Pp, Dim::DpReplicate, Dim::DpShard, Dim::Cp, Dim::Tp];

    pub fn name(self) -> &'static str {
        match self {
            Dim::Pp => "pp",
            Dim::DpReplicate => "dp_replicate",
            Dim::DpShard => "dp_shard",
            Dim::Cp => "cp",
            Dim::Tp => "tp",
        }
    }
}

/// This process's place in the job: the mesh degrees and its rank. Global rank is row-major over
/// `[pp, dp_replicate, dp_shard, cp, tp]`, as torchtitan's `world_mesh`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub pp: usize,
    /// Replicated data-parallel degree (DDP / HSDP replicas).
    pub dp_replicate: usize,
    /// Sharded data-parallel degree (FSDP shards).
    pub dp_shard: usize,
    pub cp: usize,
    pub tp: usize,
    /// Expert-parallel degree: routed experts split over `ep` ranks borrowed from
    /// `dp_shard x cp x tp` (torchtitan's sparse mesh `[pp, dp_replicate, efsdp, ep]`).
    pub ep: usize,
}

impl Mesh {
    /// One process doing everything.
    pub fn single() -> Self {
        Self {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            pp: 1,
            dp_replicate: 1,
            dp_shard: 1,
            cp: 1,
            tp: 1,
            ep: 1,
        }
    }

    /// Resolves the degrees for `world_size` ranks with torchtitan's `ParallelDims` rule and
    /// messages: every degree but `data_parallel_shard_degree` is at least 1; -1 there takes the
    /// ranks the others leave; dp_replicate x dp_shard x cp x tp x pp must equal the world size.
    /// Checked on every launch path, one process included.
    pub fn new(
        cfg: &Parallelism,
        rank: usize,
        local_rank: usize,
        world_size: usize,
    ) -> Result<Self> {
        let degrees = [
            (
                "data_parallel_replicate_degree",
                cfg.data_parallel_replicate_degree,
            ),
            ("context_parallel_degree", cfg.context_parallel_degree),
            ("tensor_parallel_degree", cfg.tensor_parallel_degree),
            ("pipeline_parallel_degree", cfg.pipeline_parallel_degree),
            ("expert_parallel_degree", cfg.expert_parallel_degree),
        ];
        for (key, d) in degrees {
            if d < 1 {
                bail!(
                    "parallelism.{key} is {d}: parallelism degree should be >= 1, except for \
                     data_parallel_shard_degree (-1: the ranks left over)"
                );
            }
        }
        let [dp_replicate, cp, tp, pp] = [
            cfg.data_parallel_replicate_degree,
            cfg.context_parallel_degree,
            cfg.tensor_parallel_degree,
            cfg.pipeline_parallel_degree,
        ]
        .map(|d| d as usize);
        let others = dp_replicate * cp * tp * pp;
        let dp_shard = match cfg.data_parallel_shard_degree {
            None if others > world_size => bail!(
                "invalid parallel dims: data_parallel_shard_degree -1 leaves no rank: \
                 dp_replicate({dp_replicate}) * cp({cp}) * tp({tp}) * pp({pp}) = {others} > \
                 WORLD_SIZE({world_size})"
            ),
            None => world_size / others,
            Some(s) => s as usize,
        };
        if others * dp_shard != world_size {
            bail!(
                "invalid parallel dims: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * \
                 cp({cp}) * tp({tp}) * pp({pp}) != WORLD_SIZE({world_size})"
            );
        }
        let ep = cfg.expert_parallel_degree as usize;
        if (dp_shard * cp * tp) % ep != 0 {
            bail!(
                "parallelism.expert_parallel_degree = {ep} must divide dp_shard({dp_shard}) * \
                 cp({cp}) * tp({tp}) = {}: expert parallelism borrows its ranks from them",
                dp_shard * cp * tp
            );
        }
        Ok(Self {
            rank,
            local_rank,
            world_size,
            pp,
            dp_replicate,
            dp_shard,
            cp,
            tp,
            ep,
        })
    }

    pub fn degree(&self, dim: Dim) -> usize {
        match dim {
            Dim::Pp => self.pp,
            Dim::DpReplicate => self.dp_replicate,
            Dim::DpShard => self.dp_shard,
            Dim::Cp => self.cp,
            Dim::Tp => self.tp,
        }
    }

    /// `rank`'s index along every dimension.
    fn coords_of(&self, rank: usize) -> [usize; 5] {
        let mut rest = rank;
        let mut out = [0; 5];
        for (i, dim) in Dim::ALL.iter().enumerate().rev() {
            let d = self.degree(*dim);
            out[i] = rest % d;
            rest /= d;
        }
        out
    }

    /// This rank's index along `dim`.
    pub fn coord(&self, dim: Dim) -> usize {
        let i = Dim::ALL.iter().position(|d| *d == dim).expect("a mesh dim");
        self.coords_of(self.rank)[i]
    }

    /// The global ranks of this rank's group over `dims` (flattened in mesh order): the ranks
    /// that agree with this one on every other dimension.
    pub fn group_members(&self, dims: &[Dim]) -> Vec<usize> {
        let me = self.coords_of(self.rank);
        (0..self.world_size)
            .filter(|&r| {
                let c = self.coords_of(r);
                Dim::ALL
                    .iter()
                    .enumerate()
                    .all(|(i, d)| dims.contains(d) || c[i] == me[i])
            })
            .collect()
    }

    /// `dp_shard x cp x tp / ep`: the ranks FSDP shards the routed experts over under expert
    /// parallelism (torchtitan's `efsdp`).
    pub fn efsdp(&self) -> usize {
        self.dp_shard * self.cp * self.tp / self.ep
    }

    /// This rank's index in `dp_shard x cp x tp` flattened, which expert parallelism splits as
    /// `[efsdp, ep]` (row-major: the `ep` ranks of one group are consecutive).
    fn sparse_index(&self, rank: usize) -> usize {
        let c = self.coords_of(rank);
        (c[2] * self.cp + c[3]) * self.tp + c[4]
    }

    /// The global ranks of this rank's `ep` group: the ranks of its `[pp, dp_replicate]` slice
    /// in the same `efsdp` row.
    pub fn ep_members(&self) -> Vec<usize> {
        let (me, c) = (self.sparse_index(self.rank), self.coords_of(self.rank));
        (0..self.world_size)
            .filter(|&r| {
                let o = self.coords_of(r);
                o[0] == c[0] && o[1] == c[1] && self.sparse_index(r) / self.ep == me / self.ep
            })
            .collect()
    }

    /// The global ranks of this rank's `efsdp` group: same `[pp, dp_replicate]` slice and the
    /// same `ep` index.
    pub fn efsdp_members(&self) -> Vec<usize> {
        let (me, c) = (self.sparse_index(self.rank), self.coords_of(self.rank));
        (0..self.world_size)
            .filter(|&r| {
                let o = self.coords_of(r);
                o[0] == c[0] && o[1] == c[1] && self.sparse_index(r) % self.ep == me % self.ep
            })
            .collect()
    }

    /// This rank's index in its `ep` group.
    pub fn ep_rank(&self) -> usize {
        self.sparse_index(self.rank) % self.ep
    }

    /// This rank's index in its `efsdp` group.
    pub fn efsdp_rank(&self) -> usize {
        self.sparse_index(self.rank) / self.ep
    }

    /// Number of data-parallel ranks (replicas x shards): how many slices the batch has.
    pub fn dp_degree(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// This rank's data-parallel index (which slice of the global batch it reads); the tensor
    /// parallel ranks of one slice read the same batches.
    pub fn dp_rank(&self) -> usize {
        self.coord(Dim::DpReplicate) * self.dp_shard + self.coord(Dim::DpShard)
    }
}

/// Meeting points for work all ranks do outside collectives (a multi-rank checkpoint save).
/// Thread-safe: async saves meet on their writer threads.
pub trait RankSync: Send + Sync {
    /// Returns once every rank called `barrier` with the same `name` (unique per meeting).
    fn barrier(&self, name: &str) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_degrees_resolve_like_torchtitan() {
        let mut cfg = Parallelism::default();
        let w = Mesh::new(&cfg, 3, 1, 4).unwrap();
        assert_eq!((w.dp_replicate, w.dp_shard, w.dp_degree()), (1, 4, 4));
        cfg.data_parallel_replicate_degree = 2;
        let w = Mesh::new(&cfg, 0, 0, 4).unwrap();
        assert_eq!((w.dp_replicate, w.dp_shard), (2, 2));
        cfg.data_parallel_shard_degree = Some(3);
        assert!(Mesh::new(&cfg, 0, 0, 4).is_err());
    }

    #[test]
    fn groups_follow_torchtitans_row_major_mesh() {
        let cfg = Parallelism {
            data_parallel_replicate_degree: 2,
            data_parallel_shard_degree: Some(2),
            tensor_parallel_degree: 2,
            ..Parallelism::default()
        };
        // rank 5 = replicate 1, shard 0, tp 1.
        let m = Mesh::new(&cfg, 5, 1, 8).unwrap();
        assert_eq!(
            (
                m.coord(Dim::DpReplicate),
                m.coord(Dim::DpShard),
                m.coord(Dim::Tp)
            ),
            (1, 0, 1)
        );
        assert_eq!(m.group_members(&[Dim::Tp]), vec![4, 5]);
        assert_eq!(m.group_members(&[Dim::DpShard]), vec![5, 7]);
        assert_eq!(m.group_members(&[Dim::DpReplicate]), vec![1, 5]);
        assert_eq!(
            m.group_members(&[Dim::DpReplicate, Dim::DpShard]),
            vec![1, 3, 5, 7]
        );
        assert_eq!((m.dp_rank(), m.dp_degree()), (2, 4));
    }

    /// torchtitan's sparse mesh `[pp, dp_replicate, efsdp, ep]` over `dp_shard x cp x tp`:
    /// the `ep` ranks of a group are consecutive, `efsdp` strides over them.
    #[test]
    fn expert_parallel_groups_borrow_from_dp_shard() {
        let cfg = Parallelism {
            data_parallel_replicate_degree: 2,
            data_parallel_shard_degree: Some(4),
            expert_parallel_degree: 2,
            ..Parallelism::default()
        };
        // rank 6 = replicate 1, shard 2.
        let m = Mesh::new(&cfg, 6, 0, 8).unwrap();
        assert_eq!((m.efsdp(), m.ep_rank(), m.efsdp_rank()), (2, 0, 1));
        assert_eq!(m.ep_members(), vec![6, 7]);
        assert_eq!(m.efsdp_members(), vec![4, 6]);
        let bad = Parallelism {
            data_parallel_shard_degree: Some(2),
            expert_parallel_degree: 4,
            ..Parallelism::default()
        };
        let err = Mesh::new(&bad, 0, 0, 2).unwrap_err().to_string();
        assert!(
            err.contains("expert_parallel_degree = 4 must divide"),
            "{err}"
        );
    }
}
