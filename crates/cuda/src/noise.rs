//! The benchmark's synthetic routers draw each next token's noise ahead
//! ([`SkewedRouting::prepare_noise`]): 512 normals and the lookahead's estimate of them, about 19 us
//! of host time a streamed block on the build machine and, at the 2.5 times the H200 host takes for
//! such work (`benchmark/notes-cuda.md`, session 17), about as long as the block's whole turn. On
//! the thread that takes the blocks' turns it could make a turn start late; this thread draws them
//! instead. The draws are a function of the seed, the layer and the token alone, so where and when
//! they run changes no routing; [`NoiseDrawer::wait`] makes sure a step's draws are done before
//! the routers' counters move on to the next token.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex};

use cherenkov_engine::routing::SkewedRouting;

/// One draw: the routing, its MoE layer, the experts a layer, and whether a lookahead predicts it.
type Job = (Arc<SkewedRouting>, usize, usize, bool);

/// A thread that draws the synthetic routers' noise, and the count of draws not yet done.
pub struct NoiseDrawer {
    jobs: Mutex<Option<Sender<Job>>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl Default for NoiseDrawer {
    fn default() -> Self {
        NoiseDrawer { jobs: Mutex::new(None), pending: Arc::new((Mutex::new(0), Condvar::new())) }
    }
}

/// Counts a draw done even where it panicked, so that [`NoiseDrawer::wait`] cannot hang on it.
struct Done(Arc<(Mutex<usize>, Condvar)>);

impl Drop for Done {
    fn drop(&mut self) {
        let (count, cv) = &*self.0;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        cv.notify_all();
    }
}

impl NoiseDrawer {
    /// Queues the draw of MoE layer `layer`'s next noise (its thread starts with the first); draws
    /// it here where the thread cannot start or has gone.
    pub fn draw(&self, sk: &Arc<SkewedRouting>, layer: usize, num_experts: usize, estimate: bool) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if jobs.is_none() {
            *jobs = self.spawn();
        }
        if let Some(tx) = jobs.as_ref() {
            *self.pending.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            match tx.send((Arc::clone(sk), layer, num_experts, estimate)) {
                Ok(()) => return,
                Err(_) => {
                    // The thread is gone: take its count back and draw here from now on.
                    drop(Done(Arc::clone(&self.pending)));
                    *jobs = None;
                }
            }
        }
        drop(jobs);
        sk.prepare_noise(layer, num_experts, estimate);
    }

    /// Waits until every queued draw is done.
    pub fn wait(&self) {
        let (count, cv) = &*self.pending;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = cv.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn spawn(&self) -> Option<Sender<Job>> {
        let (tx, rx) = channel::<Job>();
        let pending = Arc::clone(&self.pending);
        std::thread::Builder::new()
            .name("cherenkov-noise".into())
            .spawn(move || {
                // Ends when the drawer (its sender) is dropped.
                while let Ok((sk, layer, experts, estimate)) = rx.recv() {
                    let _done = Done(Arc::clone(&pending));
                    sk.prepare_noise(layer, experts, estimate);
                }
            })
            .ok()
            .map(|_| tx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cherenkov_engine::routing::Skew;

    #[test]
    fn draws_on_the_thread_leave_the_same_biases_as_draws_in_place() {
        let skew = Skew { noise: 1.0, foresight: 0.9, ..Skew::default() };
        let (layers, experts) = (6, 512);
        let here = Arc::new(SkewedRouting::new(skew));
        let there = Arc::new(SkewedRouting::new(skew));
        let drawer = NoiseDrawer::default();
        for token in 0..3 {
            for l in 0..layers {
                assert_eq!(here.bias(l, experts), there.bias(l, experts), "token {token} layer {l}");
                assert_eq!(here.predict_bias(l, experts), there.predict_bias(l, experts));
                here.prepare_noise(l, experts, true);
                drawer.draw(&there, l, experts, true);
            }
            drawer.wait();
            for l in 0..layers {
                let chosen: Vec<usize> = (0..10).map(|e| (e * 7 + token + l) % experts).collect();
                here.observe(l, &chosen, experts);
                there.observe(l, &chosen, experts);
            }
        }
        assert_eq!(*drawer.pending.0.lock().unwrap(), 0);
    }
}
