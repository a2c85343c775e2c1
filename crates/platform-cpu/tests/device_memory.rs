//! A platform whose tensor memory is not host memory (`host_kernels: false`, what
//! `CudaPlatform` reports): a host kernel's safe `TaskCtx` accessors refuse its tensors rather
//! than dereference a device address on the host.

use std::thread::JoinHandle;

use simpler_core::*;
use simpler_cpu::CpuPlatform;

/// "Device" memory: an address the host must not dereference. The memory is real host memory
/// here (so the test does not crash), but the platform says kernels must not touch it.
struct DeviceMem(Box<dyn Memory>);

// SAFETY: forwards to CPU memory; claims no host access.
unsafe impl Memory for DeviceMem {
    fn addr(&self) -> usize {
        self.0.addr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn host_accessible(&self) -> bool {
        false
    }
}

struct FakeDevice(CpuPlatform);

// SAFETY: alloc returns zeroed memory upholding `Memory`; host_kernels is false, so by the
// Platform contract this memory need not be host memory; threads from the CPU platform.
unsafe impl Platform for FakeDevice {
    fn info(&self) -> PlatformInfo {
        PlatformInfo {
            name: "fake-device".into(),
            default_cores: 1,
            host_kernels: false,
        }
    }
    fn alloc(&self, bytes: usize) -> Result<Box<dyn Memory>, PlatformError> {
        Ok(Box::new(DeviceMem(self.0.alloc(bytes)?)))
    }
    fn spawn_core(
        &self,
        index: usize,
        body: Box<dyn FnOnce() + Send>,
    ) -> Result<JoinHandle<()>, PlatformError> {
        self.0.spawn_core(index, body)
    }
}

/// A kernel reading or writing a tensor fails the run with an error naming the reason; the
/// worker stays usable: a kernel that touches no tensor runs on the same worker afterwards.
#[test]
fn host_kernels_cannot_reach_device_memory() {
    let w = Worker::new(FakeDevice(CpuPlatform::new()), WorkerConfig::default()).unwrap();
    w.register_kernel(KernelSpec::new(
        KernelId(1),
        "reads_device_memory",
        EngineClass::Vector,
        |ctx| {
            // On a real device platform this would dereference a device address on the host.
            let x = ctx.read::<f32>(0)?;
            let _ = std::hint::black_box(x.iter().sum::<f32>());
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        KernelId(2),
        "writes_device_memory",
        EngineClass::Vector,
        |ctx| {
            ctx.write::<f32>(0)?.fill(1.0);
            Ok(())
        },
    ))
    .unwrap();
    w.register_kernel(KernelSpec::new(
        KernelId(3),
        "touches_nothing",
        EngineClass::Vector,
        |_| Ok(()),
    ))
    .unwrap();
    let buf = w.alloc(64).unwrap();
    let run = |kernel: u32| {
        w.run_fn(
            "device",
            RunArgs {
                buffers: vec![buf.clone()],
                scalars: vec![],
            },
            &CallConfig::default(),
            move |o, a| {
                let t = o.bind(&a.buffers[0], DType::F32, &[16])?;
                let task = Task::new(KernelId(kernel));
                o.submit(if kernel == 2 {
                    task.output_existing(&t)
                } else {
                    task.input(&t)
                })?;
                Ok(())
            },
        )
    };
    for kernel in [1, 2] {
        let e = run(kernel)
            .expect_err("a host kernel reached a host_kernels=false platform's tensor")
            .to_string();
        assert!(e.contains("not host memory"), "{e}");
    }
    run(3).unwrap();
}
