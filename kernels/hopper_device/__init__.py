"""The Hopper (sm_90a) device code, written in Gluon: kernels that drive the tensor memory
accelerator (TMA), mbarriers and asynchronous warpgroup MMAs (wgmma) by hand, with warp
specialization. Imports nothing of ``kernels`` outside this folder. Gluon has no CPU
interpreter: this code runs on a Hopper GPU only, and the schedule takes it only there."""
