"""Reproductions of published scheduling policies, one module per paper, judged by ``policies.simulator``.

They import the product's modules (``policies.model``, ``policies.compress``, ``policies.jobs``,
``policies.simulator``); the product (the agent, the shim, ``policies.planner.plan_shim``) never imports them.

| module | paper |
|---|---|
| ``poseidon_wfbp`` | Poseidon (USENIX ATC'17): wait-free backpropagation |
| ``bytescheduler`` | P3 (MLSys'19) and ByteScheduler (SOSP'19): layer-order priority, partition, credit |
| ``us_byte`` | US-Byte (TPDS'23): unequal-sized tensor blocks |
| ``mg_wfbp`` | MG-WFBP (INFOCOM'19), PACE's fusion (INFOCOM'20): merged-gradient fusion DP |
| ``asc_wfbp`` | ASC-WFBP (INFOCOM'21): simultaneous all-reduces |
| ``pace`` | PACE (INFOCOM'20), TicTac (MLSys'19): preemptive scheduling on the DAG |
| ``tensorlights`` | TensorLights (HPBDC'19): static and rotated job order |
| ``crux`` | Crux (SIGCOMM'24): GPU-intensity job order, compressed onto levels |
| ``compare`` | the comparison of all of the tensor-side ones over a grid (``plan``, ``compare``, ``table``) |
"""
