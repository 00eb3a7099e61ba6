"""The host-CPU model's calibrations, run by ``Cluster.measure(host=HostCPU)`` after the device's
own (:mod:`fsdp_compile.planning.calibration`): :mod:`.calibrate` runs them in order;
:mod:`.cores`, :mod:`.copies`, :mod:`.reference`, :mod:`.beside_steps`, :mod:`.host_collectives` and
:mod:`.drift` hold them.

What the device calibrations' choices rest on, measured on the lab's machine (a shared 2-core
Xeon virtual machine, torch 2.13, gloo), where the package's docstrings only say the choice:

* Collectives beside compute (``cores.beside_compute``): at world 2, collectives of
  1-4 MB took 1.3-3.3x longer beside compute than alone (two trials of every kind); with fits
  timed alone, steps planned from the same calibration against the same measured steps came out
  1-4 points lower (world 2 and 4, plain gloo and an emulated link of 469 MB/s). Not where ranks
  outnumber the cores: at 2 x 2 ranks on an emulated network of 315 / 31.5 MB/s, a 70 KB
  all-reduce's median burst took 20-129 ms beside compute against 1.7-2.2 ms alone, and the
  fitted links came out anywhere from 22 MB/s to unbounded; timed alone, every fit was within
  13% of the links on that host. On another host of the same kind the same setup fitted the
  links well either way, and the planned world-4 steps differed by 1-4 points.
* Bursts, not single collectives: on an emulated link of 20 us latency a single collective
  timed from a barrier fitted 2-5 ms of latency per step and overpriced each bucket of a step by
  that much.
* An emulated network's charged time (``collectives._modeled_seconds``): at 2 x 2 ranks, bursts
  timed by the wall clock fitted 0.7-0.9 ms of latency per ring step on a 20 us link, every
  collective of a 4-rank group paid it three times over, and FULL_SHARD's planned step on a link
  as slow as its compute came out 5.6% high.
* Matmuls as a median pass: a loop over each shape, its fastest repeat kept, read 98 GFLOP/s
  where the matmuls of a training step ran at 84-94; fused attention reached about 70 GFLOP/s
  where the matmuls reached 90-98.
* Memory-bound operators on cold inputs: a loop over one hot buffer ran about twice as fast.
* The optimizer step with cold caches: a loop of steps ran 10% faster per tensor than the same
  steps after the caches were refilled. Timed again beside the steps (``beside_steps.BesideSteps``): the
  calibration's fits moved up to 2x between jobs a few minutes apart (AdamW 211-398 us per
  tensor at world 2) while the jobs' steps did not, and the jobs calibrated at the fast end had
  every strategy predicted up to 19% short (``bench/results/plan_emulated.md`` as run on
  bf75372).
* The allocator's peak read address by address: summed naively, 2-5 MiB spikes in some steps of
  a 2 x 2 hybrid world, up to 14% of the step's peak.
"""
