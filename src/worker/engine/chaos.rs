//! [`ChaosEngine`]: the node's engine faults as a filter around an engine.
//!
//! Each step first counts down a `fail_engine` fault, then sleeps a `slow` fault's delay (in
//! slices, so that clearing the fault ends it), then fails if the fault said so (the engine does
//! not run the step), then waits while a `hang` fault lasts (canary pings wait too), and only
//! then hands the batch to the engine. Logits, info and releases pass straight through.

use std::time::Duration;

use super::{EngineError, EngineInfo, StepBatch, StepEngine, StepOutput};
use crate::runtime::ids::{SeqId, WorkerId};
use crate::worker::faults::WorkerFaults;

/// How often a hung engine looks whether its hang ended.
const HANG_POLL: Duration = Duration::from_millis(20);
/// The longest slice of an injected delay before the fault is read again.
const DELAY_SLICE: Duration = Duration::from_millis(50);

/// Spawn inputs of a [`ChaosEngine`].
#[derive(Debug, Clone)]
pub struct ChaosArgs<C> {
    /// The wrapped engine's spawn inputs.
    pub inner: C,
    /// The faults aimed at this node's replicas.
    pub faults: WorkerFaults,
    /// The worker this engine belongs to (faults name workers).
    pub worker: WorkerId,
}

/// An engine whose steps obey the faults [`WorkerFaults`] holds for its worker.
#[derive(Debug)]
pub struct ChaosEngine<E> {
    inner: E,
    faults: WorkerFaults,
    worker: WorkerId,
}

/// Sleeps `worker`'s `slow` delay as it stands now; returns early once the fault is cleared.
async fn slow_down(faults: &WorkerFaults, worker: &WorkerId) {
    let delay = faults.step_delay(worker);
    if delay.is_zero() {
        return;
    }
    let until = tokio::time::Instant::now() + delay;
    while tokio::time::Instant::now() < until && !faults.step_delay(worker).is_zero() {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        tokio::time::sleep(left.min(DELAY_SLICE)).await;
    }
}

/// Waits while a `hang` fault holds `worker`, as a wedged device would.
async fn wait_while_hung(faults: &WorkerFaults, worker: &WorkerId) {
    while faults.hangs(worker) {
        tokio::time::sleep(HANG_POLL).await;
    }
}

impl<E: StepEngine> StepEngine for ChaosEngine<E> {
    type Config = ChaosArgs<E::Config>;

    async fn start(args: ChaosArgs<E::Config>) -> Result<Self, EngineError> {
        Ok(Self {
            inner: E::start(args.inner).await?,
            faults: args.faults,
            worker: args.worker,
        })
    }

    fn info(&self) -> EngineInfo {
        self.inner.info()
    }

    async fn step(&mut self, batch: StepBatch) -> Result<StepOutput, EngineError> {
        let fails = self.faults.step_fails(&self.worker);
        slow_down(&self.faults, &self.worker).await;
        if fails {
            return Err(EngineError::Injected);
        }
        wait_while_hung(&self.faults, &self.worker).await;
        self.inner.step(batch).await
    }

    async fn logits(&mut self, batch: StepBatch) -> Result<Vec<Vec<f32>>, EngineError> {
        self.inner.logits(batch).await
    }

    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq);
    }

    async fn ping(&mut self) {
        wait_while_hung(&self.faults, &self.worker).await;
        self.inner.ping().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::faults::ReplicaFault;

    /// Counts the steps it ran; answers at once.
    #[derive(Debug, Default)]
    struct Counting {
        steps: usize,
    }

    impl StepEngine for Counting {
        type Config = ();

        async fn start((): ()) -> Result<Self, EngineError> {
            Ok(Self::default())
        }

        fn info(&self) -> EngineInfo {
            EngineInfo {
                device: "counting".into(),
                num_blocks: 1,
                block_size: 1,
                vocab_size: 1,
                max_context: 1,
                block_bytes: 0,
                kv_bytes: 0,
            }
        }

        async fn step(&mut self, _batch: StepBatch) -> Result<StepOutput, EngineError> {
            self.steps += 1;
            Ok(StepOutput::default())
        }

        async fn logits(&mut self, _batch: StepBatch) -> Result<Vec<Vec<f32>>, EngineError> {
            Ok(Vec::new())
        }

        fn release(&mut self, _seq: SeqId) {}
    }

    fn engine() -> (WorkerFaults, WorkerId, ChaosEngine<Counting>) {
        let (faults, worker) = (WorkerFaults::default(), WorkerId::new("n/r0"));
        let e = ChaosEngine {
            inner: Counting::default(),
            faults: faults.clone(),
            worker: worker.clone(),
        };
        (faults, worker, e)
    }

    fn inject(faults: &WorkerFaults, id: u64, fault: ReplicaFault, worker: &WorkerId) {
        faults.set(id, worker, fault);
    }

    #[tokio::test(start_paused = true)]
    async fn without_faults_steps_pass_straight_through() {
        let (_, _, mut e) = engine();
        let t0 = tokio::time::Instant::now();
        assert_eq!(
            e.step(StepBatch::default()).await,
            Ok(StepOutput::default())
        );
        e.ping().await;
        assert_eq!(t0.elapsed(), Duration::ZERO);
        assert_eq!(e.inner.steps, 1);
        assert_eq!(e.info().device, "counting");
    }

    #[tokio::test(start_paused = true)]
    async fn fail_engine_fails_steps_after_the_ones_it_spares() {
        let (faults, worker, mut e) = engine();
        inject(&faults, 1, ReplicaFault::FailAfter(1), &worker);
        assert!(e.step(StepBatch::default()).await.is_ok());
        assert_eq!(
            e.step(StepBatch::default()).await,
            Err(EngineError::Injected)
        );
        assert_eq!(e.inner.steps, 1, "a failed step never reaches the engine");
        faults.clear(1);
        assert!(e.step(StepBatch::default()).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn slow_delays_each_step_and_clearing_it_ends_the_delay() {
        let (faults, worker, mut e) = engine();
        inject(
            &faults,
            1,
            ReplicaFault::Slow(Duration::from_millis(200)),
            &worker,
        );
        let t0 = tokio::time::Instant::now();
        assert!(e.step(StepBatch::default()).await.is_ok());
        assert_eq!(t0.elapsed(), Duration::from_millis(200));
        inject(
            &faults,
            2,
            ReplicaFault::Slow(Duration::from_millis(600_000)),
            &worker,
        );
        let clear = tokio::spawn({
            let faults = faults.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(1000)).await;
                faults.clear(1);
                faults.clear(2);
            }
        });
        let t1 = tokio::time::Instant::now();
        assert!(e.step(StepBatch::default()).await.is_ok());
        assert!(t1.elapsed() < Duration::from_millis(1000) + DELAY_SLICE * 2);
        clear.await.expect("clear");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hang_holds_steps_and_pings_until_it_ends() {
        let (faults, worker, mut e) = engine();
        inject(&faults, 1, ReplicaFault::Hang, &worker);
        let end = tokio::spawn({
            let (faults, worker) = (faults.clone(), worker.clone());
            async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                faults.end_hangs(&worker);
            }
        });
        let t0 = tokio::time::Instant::now();
        e.ping().await;
        assert!(t0.elapsed() >= Duration::from_millis(500));
        end.await.expect("end");
        inject(&faults, 2, ReplicaFault::Hang, &worker);
        let step = tokio::time::timeout(Duration::from_secs(5), e.step(StepBatch::default()));
        assert!(step.await.is_err(), "a hung engine does not answer");
        assert_eq!(e.inner.steps, 0);
        // Other workers' engines are not hit.
        let mut other = ChaosEngine::<Counting>::start(ChaosArgs {
            inner: (),
            faults: faults.clone(),
            worker: WorkerId::new("n/r1"),
        })
        .await
        .expect("start");
        assert!(other.step(StepBatch::default()).await.is_ok());
    }
}
