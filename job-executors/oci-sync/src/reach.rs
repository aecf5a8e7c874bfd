//! Where the runner itself may connect on a job's behalf (registries, cluster APIs).
//!
//! The runner runs outside every sandbox, on the host's network, with the instance
//! role's metadata service and its own loopback services in reach. A job names
//! registries and API servers; a hostile one names the metadata service, the host's
//! loopback or one of the host's own addresses, plain HTTP, or a name whose DNS answer
//! is one of those. So: HTTPS only, and no loopback, link-local (IMDS, ECS and EKS
//! credential addresses), IMDS-over-IPv6, unspecified, multicast or host address —
//! checked on the URL (literal addresses, before the claim and before each request,
//! redirects included) and on every DNS answer the runner's clients use. An endpoint
//! the customer names in the runner's own configuration is reached as configured.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use url::Url;

/// Why the runner will not connect somewhere for a job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("{url}: not HTTPS; the runner reaches what a job names over HTTPS only")]
    NotHttps { url: String },
    #[error(
        "{host}: {class}; the runner connects there for a job only when its configuration names the endpoint ([oci] registry_endpoints, [kubernetes] allowed_servers; run-local: --endpoint, --allow-cluster-server)"
    )]
    Address { host: String, class: &'static str },
    #[error("{url}: not a URL the runner reaches ({why})")]
    Invalid { url: String, why: String },
}

/// The rule for one kind of endpoint: guarded (what jobs name), or open (the
/// customer's own command line, where the customer typed the address).
#[derive(Debug, Clone, Default)]
pub struct Reach {
    guard: Option<Arc<Guard>>,
}

#[derive(Debug, Default)]
struct Guard {
    /// `host:port` (lowercase) the customer's configuration names: reached as configured.
    allowed: BTreeSet<String>,
    /// Their hosts, for DNS answers (a resolver does not know the port).
    allowed_hosts: BTreeSet<String>,
}

impl Reach {
    /// No checks: for the customer's own commands.
    pub fn open() -> Reach {
        Reach { guard: None }
    }

    /// The job rule, with `allowed` (`host:port`, or URLs whose authority is taken)
    /// exempt: endpoints the customer's configuration names.
    pub fn guarded<I, S>(allowed: I) -> Reach
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut g = Guard::default();
        for a in allowed {
            let a = a.as_ref().trim();
            let authority = match Url::parse(a) {
                Ok(u) if u.host_str().is_some() => authority_of(&u),
                _ => a.to_ascii_lowercase(),
            };
            g.allowed_hosts.insert(host_part(&authority).to_string());
            g.allowed.insert(authority);
        }
        Reach { guard: Some(Arc::new(g)) }
    }

    pub fn is_guarded(&self) -> bool {
        self.guard.is_some()
    }

    /// Whether the customer's configuration names this `host[:port]`.
    pub fn allows_authority(&self, authority: &str) -> bool {
        self.guard.as_ref().is_none_or(|g| g.allowed.contains(&authority.to_ascii_lowercase()))
    }

    /// A URL the runner is about to fetch: HTTPS, and a host that is not a refused
    /// address (a name is checked again when it resolves).
    pub fn check_url(&self, url: &Url) -> Result<(), Refused> {
        let Some(g) = &self.guard else { return Ok(()) };
        if url.host_str().is_none() {
            return Err(Refused::Invalid { url: url.to_string(), why: "no host".into() });
        }
        if g.allowed.contains(&authority_of(url)) {
            return Ok(());
        }
        if url.scheme() != "https" {
            return Err(Refused::NotHttps { url: url.to_string() });
        }
        self.check_host(url.host_str().unwrap_or_default())
    }

    /// A registry named `host[:port]` in a reference, reached at `https://host[:port]`.
    pub fn check_registry(&self, registry: &str) -> Result<(), Refused> {
        if self.allows_authority(registry) {
            return Ok(());
        }
        let url = Url::parse(&format!("https://{registry}/"))
            .map_err(|e| Refused::Invalid { url: registry.to_string(), why: e.to_string() })?;
        self.check_url(&url)
    }

    /// A host as written in a URL: a literal address is classified now; `localhost`
    /// names are refused outright. (An allowed endpoint is matched with its port, by
    /// [`check_url`](Self::check_url), before this.)
    pub fn check_host(&self, host: &str) -> Result<(), Refused> {
        if self.guard.is_none() {
            return Ok(());
        }
        let bare =
            host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase();
        if bare == "localhost" || bare.ends_with(".localhost") {
            return Err(Refused::Address { host: host.to_string(), class: "a loopback name" });
        }
        match bare.parse::<IpAddr>() {
            Ok(ip) => match class_of(ip, &own_addresses(host)?) {
                Some(class) => Err(Refused::Address { host: host.to_string(), class }),
                None => Ok(()),
            },
            Err(_) => Ok(()),
        }
    }

    /// What a DNS lookup of `host` answered: every address must be one the runner may
    /// reach (a name that answers with one refused address is refused whole).
    pub fn check_resolved(&self, host: &str, addrs: &[SocketAddr]) -> Result<(), Refused> {
        let Some(g) = &self.guard else { return Ok(()) };
        let bare = host.trim_end_matches('.').to_ascii_lowercase();
        if g.allowed_hosts.contains(&bare) {
            return Ok(());
        }
        let own = own_addresses(host)?;
        for a in addrs {
            if let Some(class) = class_of(a.ip(), &own) {
                return Err(Refused::Address { host: format!("{host} (resolves to {})", a.ip()), class });
            }
        }
        Ok(())
    }
}

/// `host[:port]` of a URL, lowercase, the port only when the URL names one.
fn authority_of(url: &Url) -> String {
    let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
    match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host,
    }
}

fn host_part(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    }
}

/// Why an address is refused, or `None` for one the runner may reach for a job.
pub fn class_of(ip: IpAddr, host_addrs: &[IpAddr]) -> Option<&'static str> {
    let own = |ip: IpAddr| host_addrs.contains(&ip).then_some("an address of this host");
    match ip {
        IpAddr::V4(v4) => class_of_v4(v4).or_else(|| own(ip)),
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_v4(v6) {
                return class_of_v4(v4).or_else(|| own(IpAddr::V4(v4))).or_else(|| own(ip));
            }
            let s = v6.segments();
            if v6.is_loopback() {
                Some("a loopback address")
            } else if v6.is_unspecified() {
                Some("the unspecified address")
            } else if s[0] == 0xfd00 && s[1] == 0x0ec2 {
                Some("the instance metadata service (fd00:ec2::/32)")
            } else if s[0] & 0xffc0 == 0xfe80 {
                Some("a link-local address")
            } else if v6.is_multicast() {
                Some("a multicast address")
            } else {
                own(ip)
            }
        }
    }
}

fn class_of_v4(v4: Ipv4Addr) -> Option<&'static str> {
    if v4.is_loopback() {
        Some("a loopback address")
    } else if v4.is_link_local() {
        Some("a link-local address (the instance metadata service and the ECS/EKS credential endpoints)")
    } else if v4.is_unspecified() || v4.octets()[0] == 0 {
        Some("the unspecified address")
    } else if v4.is_broadcast() || v4.is_multicast() {
        Some("a broadcast or multicast address")
    } else {
        None
    }
}

/// The IPv4 address an IPv6 one carries: mapped (`::ffff:a.b.c.d`), compatible
/// (`::a.b.c.d`) or the NAT64 well-known prefix (`64:ff9b::/96`), through which a
/// DNS64 resolver could hand out the metadata service.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    if s[..6] == [0, 0, 0, 0, 0, 0] && !(s[6] == 0 && s[7] <= 1) {
        return Some(tail);
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        return Some(tail);
    }
    None
}

/// This host's addresses, or a refusal when they cannot be listed: an address the
/// runner cannot tell from its own is not connected to (fail closed).
fn own_addresses(host: &str) -> Result<Vec<IpAddr>, Refused> {
    host_addresses().map_err(|e| Refused::Address {
        host: host.to_string(),
        class: if e == nix::errno::Errno::EMFILE {
            "not checkable now (out of file descriptors listing this host's addresses)"
        } else {
            "not checkable (this host's addresses could not be listed)"
        },
    })
}

/// Every address of this host's interfaces (the runner's network namespace).
pub fn host_addresses() -> nix::Result<Vec<IpAddr>> {
    let addrs = nix::ifaddrs::getifaddrs()?;
    let mut out: Vec<IpAddr> = addrs
        .filter_map(|ifa| {
            let a = ifa.address?;
            if let Some(v4) = a.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// reqwest's resolver for guarded clients: the system's answer, refused whole when one
/// address is refused. The customer's proxy (`HTTPS_PROXY` and friends in the runner's
/// environment, which reqwest honours) is the one name it resolves unchecked: with a
/// proxy, the proxy resolves the job's names, and the runner's rule holds for every URL
/// it asks for.
#[derive(Debug, Clone)]
pub struct GuardedResolver {
    reach: Reach,
    proxies: Arc<BTreeSet<String>>,
}

impl GuardedResolver {
    pub fn new(reach: Reach) -> GuardedResolver {
        let proxies = ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
            .iter()
            .filter_map(|v| std::env::var(v).ok())
            .filter_map(|p| Url::parse(&p).ok()?.host_str().map(str::to_ascii_lowercase))
            .collect();
        GuardedResolver { reach, proxies: Arc::new(proxies) }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (reach, proxies) = (self.reach.clone(), self.proxies.clone());
        Box::pin(async move {
            let host = name.as_str().to_string();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if !proxies.contains(&host.to_ascii_lowercase()) {
                reach.check_resolved(&host, &addrs)?;
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(r: &Reach, url: &str) -> bool {
        r.check_url(&Url::parse(url).expect("url")).is_err()
    }

    #[test]
    fn addresses_the_runner_must_not_reach_for_a_job() {
        let own: Vec<IpAddr> = vec!["10.1.2.3".parse().expect("ip")];
        for bad in [
            "127.0.0.1",
            "127.8.9.10",
            "169.254.169.254",
            "169.254.170.2",
            "169.254.170.23",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00:ec2::254",
            "fd00:ec2::23",
            "::ffff:169.254.169.254",
            "::ffff:127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "::127.0.0.1",
            "10.1.2.3",
            "::ffff:10.1.2.3",
        ] {
            assert!(class_of(bad.parse().expect("ip"), &own).is_some(), "{bad}");
        }
        for fine in ["10.0.0.5", "192.168.1.10", "203.0.113.7", "2600:1f18::1", "fd12::1"] {
            assert_eq!(class_of(fine.parse().expect("ip"), &own), None, "{fine}");
        }
    }

    #[test]
    fn guarded_urls_are_https_to_addresses_that_may_be_reached() {
        let r = Reach::guarded(["127.0.0.1:5000", "http://localhost:6443"]);
        assert!(!refused(&r, "https://registry.example.com/v2/"));
        assert!(!refused(&r, "https://10.0.0.5:443/"));
        for bad in [
            "http://registry.example.com/v2/",
            "https://127.0.0.1:5001/",
            "https://169.254.169.254/latest/meta-data/",
            "https://[fd00:ec2::254]/",
            "https://[::ffff:127.0.0.1]:5000/",
            "https://localhost:5001/",
            "https://api.localhost/",
            "ftp://registry.example.com/",
        ] {
            assert!(refused(&r, bad), "{bad}");
        }
        // What the customer's configuration names is reached as configured.
        assert!(!refused(&r, "http://127.0.0.1:5000/v2/"));
        assert!(!refused(&r, "http://localhost:6443/api"));
        assert!(r.check_registry("127.0.0.1:5000").is_ok());
        assert!(r.check_registry("127.0.0.1:5001").is_err());
        assert!(r.check_registry("registry.example.com").is_ok());
        // The open rule (the customer's own command) checks nothing.
        assert!(!refused(&Reach::open(), "http://127.0.0.1:1/"));
    }

    #[test]
    fn a_name_answering_with_a_refused_address_is_refused_whole() {
        let r = Reach::guarded(["allowed.internal:443"]);
        let addr = |s: &str| SocketAddr::new(s.parse().expect("ip"), 0);
        assert!(r.check_resolved("ok.example", &[addr("203.0.113.7")]).is_ok());
        assert!(r.check_resolved("evil.example", &[addr("203.0.113.7"), addr("169.254.169.254")]).is_err());
        assert!(r.check_resolved("evil.example", &[addr("::1")]).is_err());
        assert!(r.check_resolved("allowed.internal", &[addr("127.0.0.1")]).is_ok());
        let own = host_addresses().expect("this host's addresses");
        if let Some(a) = own.iter().find(|a| !a.is_loopback()) {
            assert!(r.check_resolved("me.example", &[SocketAddr::new(*a, 0)]).is_err(), "{a}");
        }
    }
}
