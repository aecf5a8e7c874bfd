// verify_audit checks a byoc-runner audit directory with the Go team's transparency-log
// packages (golang.org/x/mod/sumdb/note and sumdb/tlog), as a third party would: every
// acknowledged checkpoint opened with the published verifier keys (runner and control
// plane), its root recomputed from log.jsonl (RFC 6962 leaves), consistency between
// consecutive checkpoints and inclusion of every record proved and checked.
//
//	go run verify_audit.go AUDIT_DIR RUNNER_VKEY CONTROL_PLANE_VKEY
package main

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

type hashes []tlog.Hash

func (h hashes) ReadHashes(indexes []int64) ([]tlog.Hash, error) {
	out := make([]tlog.Hash, len(indexes))
	for i, x := range indexes {
		if x >= int64(len(h)) {
			return nil, fmt.Errorf("hash %d not stored", x)
		}
		out[i] = h[x]
	}
	return out, nil
}

func lines(path string) []string {
	f, err := os.Open(path)
	if err != nil {
		fail("%v", err)
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<24)
	for s.Scan() {
		out = append(out, s.Text())
	}
	return out
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "verify_audit: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) != 4 {
		fail("usage: verify_audit AUDIT_DIR RUNNER_VKEY CONTROL_PLANE_VKEY")
	}
	dir := os.Args[1]
	var verifiers []note.Verifier
	for _, k := range os.Args[2:] {
		v, err := note.NewVerifier(k)
		if err != nil {
			fail("verifier key %q: %v", k, err)
		}
		verifiers = append(verifiers, v)
	}
	known := note.VerifierList(verifiers...)

	// The tree of every record, as RFC 6962 stores it.
	records := lines(filepath.Join(dir, "log.jsonl"))
	var stored hashes
	for i, r := range records {
		hs, err := tlog.StoredHashes(int64(i), []byte(r), stored)
		if err != nil {
			fail("record %d: %v", i, err)
		}
		stored = append(stored, hs...)
	}

	type checkpoint struct {
		Size int64  `json:"size"`
		Note string `json:"note"`
	}
	var sizes []int64
	var roots []tlog.Hash
	for i, line := range lines(filepath.Join(dir, "cosigned.jsonl")) {
		var c checkpoint
		if err := json.Unmarshal([]byte(line), &c); err != nil {
			fail("cosigned line %d: %v", i+1, err)
		}
		n, err := note.Open([]byte(c.Note), known)
		if err != nil {
			fail("cosigned line %d: %v", i+1, err)
		}
		if len(n.Sigs) != len(verifiers) {
			fail("cosigned line %d: %d of %d signers verified", i+1, len(n.Sigs), len(verifiers))
		}
		body := strings.Split(n.Text, "\n")
		if len(body) < 4 || body[0] != verifiers[0].Name() {
			fail("cosigned line %d: origin %q is not the key's name %q", i+1, body[0], verifiers[0].Name())
		}
		size, err := strconv.ParseInt(body[1], 10, 64)
		if err != nil || size != c.Size || size > int64(len(records)) {
			fail("cosigned line %d: size %q", i+1, body[1])
		}
		raw, err := base64.StdEncoding.DecodeString(body[2])
		if err != nil || len(raw) != tlog.HashSize {
			fail("cosigned line %d: root %q", i+1, body[2])
		}
		var root tlog.Hash
		copy(root[:], raw)
		th, err := tlog.TreeHash(size, stored)
		if err != nil || th != root {
			fail("cosigned line %d: root %s is not the tree of the first %d records (%s)", i+1, root, size, th)
		}
		if k := len(sizes); k > 0 && sizes[k-1] <= size {
			proof, err := tlog.ProveTree(size, sizes[k-1], stored)
			if err != nil {
				fail("consistency %d..%d: %v", sizes[k-1], size, err)
			}
			if err := tlog.CheckTree(proof, size, root, sizes[k-1], roots[k-1]); err != nil {
				fail("consistency %d..%d: %v", sizes[k-1], size, err)
			}
		}
		for r := int64(0); r < size; r++ {
			proof, err := tlog.ProveRecord(size, r, stored)
			if err != nil {
				fail("inclusion of %d in %d: %v", r, size, err)
			}
			if err := tlog.CheckRecord(proof, size, root, r, tlog.RecordHash([]byte(records[r]))); err != nil {
				fail("inclusion of %d in %d: %v", r, size, err)
			}
		}
		sizes = append(sizes, size)
		roots = append(roots, root)
	}
	if len(sizes) == 0 {
		fail("no acknowledged checkpoint")
	}
	fmt.Printf("ok: %d checkpoints, %d records\n", len(sizes), len(records))
}
