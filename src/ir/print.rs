//! A jaxpr-like printout of a graph, for debugging:
//!
//! ```text
//! { lambda %0:f32[3,4] %1:f32[4] .
//!     %2:f32[3,4] = mul %0 %1
//!     %3:f32[3] = sum[axes=[1]] %2
//!   in (%3) }
//! ```
//!
//! A node with several results shows their types, and each `get[k]` one:
//! `%5:(f32[4], f32[10,4]) = scan[..] %0 %1`, `%6:f32[4] = get[0] %5`.

use super::{Graph, TensorType};
use std::fmt;

fn dtype_name(t: &TensorType) -> String {
    format!("{:?}", t.dtype).to_lowercase()
}

fn type_name(t: &TensorType) -> String {
    let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
    format!("{}[{}]", dtype_name(t), dims.join(","))
}

fn typed(v: usize, t: &TensorType) -> String {
    format!("%{v}:{}", type_name(t))
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ins: Vec<String> = self.inputs.iter().map(|&v| typed(v, self.ty(v))).collect();
        writeln!(f, "{{ lambda {} .", ins.join(" "))?;
        for (v, node) in self.nodes.iter().enumerate() {
            if matches!(node.prim, super::Prim::Input(_)) {
                continue;
            }
            let args: Vec<String> = node.args.iter().map(|a| format!("%{a}")).collect();
            let sep = if args.is_empty() { "" } else { " " };
            // a node with several results shows their types
            let ty = match node.prim.results() {
                Some(rs) => format!("%{v}:({})", rs.iter().map(type_name).collect::<Vec<_>>().join(", ")),
                None => typed(v, &node.ty),
            };
            writeln!(f, "    {ty} = {}{sep}{}", node.prim.name(), args.join(" "))?;
        }
        let outs: Vec<String> = self.outputs.iter().map(|v| format!("%{v}")).collect();
        write!(f, "  in ({}) }}", outs.join(", "))
    }
}
