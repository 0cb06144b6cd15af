//! The `EngineWorker` actor: Step / Logits / Info calls and Release casts.

#[path = "common/model.rs"]
mod model;

use std::sync::Arc;

use crate::model::{blocks, golden, model, seq};
use flotilla::actors::engine_worker::{EngineWorker, EngineWorkerMsg};
use flotilla::runtime::ids::SeqId;
use flotilla::worker::engine::{
    EngineConfig, EngineError, StepBatch, TransformerArgs, TransformerEngine,
};
use ractor::{Actor, call_t};

#[tokio::test]
async fn actor_steps_greedy_like_the_golden() {
    let m = model();
    let args = TransformerArgs {
        weights: Arc::clone(&m.weights),
        config: EngineConfig {
            num_blocks: 8,
            ..EngineConfig::default()
        },
        transport: None,
        kv_region: None,
    };
    let (actor, handle) = Actor::spawn(None, EngineWorker::<TransformerEngine>::new(), args)
        .await
        .expect("spawn");
    let info = call_t!(actor, EngineWorkerMsg::Info, 5_000).expect("info");
    assert_eq!(
        (info.num_blocks, info.block_size, info.vocab_size),
        (8, 16, 49_152)
    );

    let case = &golden()[0];
    let table = blocks(0..4);
    let mut next = case.prompt_ids.clone();
    let mut pos = 0;
    let mut out = Vec::new();
    for _ in 0..case.greedy_ids.len() {
        let batch = StepBatch {
            seqs: vec![seq(7, &next, pos, &table, true)],
        };
        let r = call_t!(actor, EngineWorkerMsg::Step, 30_000, batch).expect("call");
        let t = r.expect("step").tokens.swap_remove(0);
        assert_eq!(t.seq_id, SeqId(7));
        assert!(t.logprob <= 0.0);
        pos += next.len();
        next = vec![t.token];
        out.push(t.token);
    }
    assert_eq!(out, case.greedy_ids);

    // A malformed batch is a typed error and the actor keeps serving.
    let bad = StepBatch {
        seqs: vec![seq(8, &[1; 70], 0, &table, true)],
    };
    let r = call_t!(actor, EngineWorkerMsg::Step, 30_000, bad).expect("call");
    assert!(matches!(r, Err(EngineError::InvalidBatch(_))));
    actor
        .cast(EngineWorkerMsg::Release(SeqId(7)))
        .expect("cast");
    let l = call_t!(
        actor,
        EngineWorkerMsg::Logits,
        30_000,
        StepBatch {
            seqs: vec![seq(9, &case.prompt_ids, 0, &table, false)]
        }
    )
    .expect("call")
    .expect("logits");
    assert_eq!(l.len(), 1);
    assert_eq!(flotilla::kernels::sample::argmax(&l[0]), case.greedy_ids[0]);

    actor.stop(None);
    handle.await.expect("join");
}
