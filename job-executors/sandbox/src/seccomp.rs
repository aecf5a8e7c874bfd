//! The job's system-call filter: everything is allowed except what lets a job reach
//! beyond its sandbox or the kernel's privileged interfaces. Denied calls fail with
//! EPERM (tools handle that better than being killed).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

#[derive(Debug, thiserror::Error)]
#[error("building the seccomp filter: {0}")]
pub struct SeccompError(String);

/// Denied outright.
const DENIED: &[i64] = &[
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    // Another process's descriptor (the runner's capture pipe in a render) or memory
    // advice: same uid is not enough to reach another process of the job.
    libc::SYS_pidfd_getfd,
    libc::SYS_process_madvise,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_userfaultfd,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_lookup_dcookie,
];

/// `clone` is allowed, but not with a flag that creates a namespace.
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWCGROUP as u64,
    0x80, // CLONE_NEWTIME
];

/// `AUDIT_ARCH_*` of this build's architecture (`<linux/audit.h>`).
#[cfg(target_arch = "aarch64")]
const NATIVE_AUDIT_ARCH: u32 = 0xC000_00B7;
#[cfg(not(target_arch = "aarch64"))]
const NATIVE_AUDIT_ARCH: u32 = 0xC000_003E;

/// x86-64's x32 ABI shares the native audit arch and marks its calls with this bit in the
/// number (`__X32_SYSCALL_BIT`): a filter that lists native numbers never matches them, so
/// an x32 `unshare` would pass a deny list. (On aarch64 no number has the bit.)
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// The first program: any architecture but the native one (i386 through `int 0x80`, say)
/// kills the process, and on x86-64 every x32 call fails with EPERM. The deny list
/// after it then only ever sees native numbers.
fn abi_filter() -> BpfProgram {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let stmt = |code: u32, k: u32| seccompiler::sock_filter { code: code as u16, jt: 0, jf: 0, k };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| seccompiler::sock_filter { code: code as u16, jt, jf, k };
    // struct seccomp_data { int nr; __u32 arch; ... }
    const NR: u32 = 0;
    const ARCH: u32 = 4;
    vec![
        stmt(BPF_LD | BPF_W | BPF_ABS, ARCH),
        jump(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_AUDIT_ARCH, 1, 0),
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD | BPF_W | BPF_ABS, NR),
        jump(BPF_JMP | BPF_JGE | BPF_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW),
    ]
}

fn arch() -> seccompiler::TargetArch {
    #[cfg(target_arch = "aarch64")]
    return seccompiler::TargetArch::aarch64;
    #[cfg(not(target_arch = "aarch64"))]
    seccompiler::TargetArch::x86_64
}

/// The filters to install, in order: the ABI filter, then two programs because their
/// actions differ: `clone3` answers ENOSYS (its flags sit in memory a filter cannot read, and ENOSYS
/// makes libc fall back to `clone`, whose flags the main filter checks).
pub fn job_filters() -> Result<Vec<BpfProgram>, SeccompError> {
    let err = |e: &dyn std::fmt::Display| SeccompError(e.to_string());
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|s| (*s, vec![])).collect();
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|flag| {
            let cond =
                SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(*flag), *flag)
                    .map_err(|e| err(&e))?;
            SeccompRule::new(vec![cond]).map_err(|e| err(&e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    let main =
        SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch())
            .map_err(|e| err(&e))?;
    let clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, vec![])].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch(),
    )
    .map_err(|e| err(&e))?;
    Ok(vec![abi_filter(), main.try_into().map_err(|e| err(&e))?, clone3.try_into().map_err(|e| err(&e))?])
}

pub fn apply(filters: &[BpfProgram]) -> Result<(), SeccompError> {
    for f in filters {
        seccompiler::apply_filter(f).map_err(|e| SeccompError(e.to_string()))?;
    }
    Ok(())
}

/// The same policy as a Docker seccomp profile (JSON), for `action.container`: allow by
/// default, EPERM for the denied calls and for `clone` with a namespace flag, ENOSYS
/// for `clone3`. Syscall names come from the kernel's numbers via the libc table below.
pub fn docker_profile() -> String {
    let names: Vec<&str> = DENIED.iter().filter_map(|n| syscall_name(*n)).collect();
    let clone_rules: Vec<serde_json::Value> = NAMESPACE_FLAGS
        .iter()
        .map(|f| {
            serde_json::json!({
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": libc::EPERM,
                "args": [{"index": 0, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ"}]
            })
        })
        .collect();
    let mut syscalls = vec![
        serde_json::json!({"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM}),
        serde_json::json!({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::ENOSYS}),
    ];
    syscalls.extend(clone_rules);
    serde_json::json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],
        "syscalls": syscalls,
    })
    .to_string()
}

fn syscall_name(nr: i64) -> Option<&'static str> {
    Some(match nr {
        libc::SYS_ptrace => "ptrace",
        libc::SYS_process_vm_readv => "process_vm_readv",
        libc::SYS_process_vm_writev => "process_vm_writev",
        libc::SYS_pidfd_getfd => "pidfd_getfd",
        libc::SYS_process_madvise => "process_madvise",
        libc::SYS_mount => "mount",
        libc::SYS_umount2 => "umount2",
        libc::SYS_pivot_root => "pivot_root",
        libc::SYS_chroot => "chroot",
        libc::SYS_open_tree => "open_tree",
        libc::SYS_move_mount => "move_mount",
        libc::SYS_fsopen => "fsopen",
        libc::SYS_fsconfig => "fsconfig",
        libc::SYS_fsmount => "fsmount",
        libc::SYS_fspick => "fspick",
        libc::SYS_mount_setattr => "mount_setattr",
        libc::SYS_unshare => "unshare",
        libc::SYS_setns => "setns",
        libc::SYS_kexec_load => "kexec_load",
        libc::SYS_kexec_file_load => "kexec_file_load",
        libc::SYS_init_module => "init_module",
        libc::SYS_finit_module => "finit_module",
        libc::SYS_delete_module => "delete_module",
        libc::SYS_bpf => "bpf",
        libc::SYS_perf_event_open => "perf_event_open",
        libc::SYS_keyctl => "keyctl",
        libc::SYS_add_key => "add_key",
        libc::SYS_request_key => "request_key",
        libc::SYS_userfaultfd => "userfaultfd",
        libc::SYS_open_by_handle_at => "open_by_handle_at",
        libc::SYS_name_to_handle_at => "name_to_handle_at",
        libc::SYS_swapon => "swapon",
        libc::SYS_swapoff => "swapoff",
        libc::SYS_reboot => "reboot",
        libc::SYS_acct => "acct",
        libc::SYS_quotactl => "quotactl",
        libc::SYS_syslog => "syslog",
        libc::SYS_settimeofday => "settimeofday",
        libc::SYS_clock_settime => "clock_settime",
        libc::SYS_clock_adjtime => "clock_adjtime",
        libc::SYS_adjtimex => "adjtimex",
        libc::SYS_iopl => "iopl",
        libc::SYS_ioperm => "ioperm",
        libc::SYS_lookup_dcookie => "lookup_dcookie",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_denied_call_has_a_name_in_the_docker_profile() {
        for nr in DENIED {
            assert!(syscall_name(*nr).is_some(), "syscall {nr} has no name");
        }
        let profile: serde_json::Value = serde_json::from_str(&docker_profile()).unwrap();
        let names = profile["syscalls"][0]["names"].as_array().unwrap();
        assert_eq!(names.len(), DENIED.len());
        assert!(names.iter().any(|n| n == "ptrace") && names.iter().any(|n| n == "unshare"));
    }

    #[test]
    fn filters_build_for_this_architecture() {
        assert_eq!(job_filters().unwrap().len(), 3);
    }
}
