//! A sorted map for the arena's indexes: keys in order, in chunks of at
//! most `N` entries ([`CHUNK`] unless a map sets it), each a sorted
//! array, with the first key of every chunk in an array of its own.
//!
//! The arena asks mostly for neighbours: the entry at or before an
//! address, the one after it, the entries of a short span. Here such a
//! query is two binary searches over contiguous memory (the chunks' first
//! keys, then one chunk), where `std`'s `BTreeMap::range` descends the tree
//! once for each bound, and an insert or a remove moves at most a chunk's
//! entries. A chunk that outgrows `N` splits in two; one that falls
//! below a quarter of it joins a neighbour, so there are at most about
//! `4 * len / N` chunks, and splitting or joining moves that many first
//! keys (once every `N / 4` updates of a chunk at most). Shorter chunks
//! make an update move fewer entries, longer ones make a walk over many
//! entries cross fewer chunks.

/// Most entries of one chunk, unless a map says otherwise (its `N`).
pub(crate) const CHUNK: usize = 32;

/// A place in an [`OrdMap`] found by [`OrdMap::lower_bound`]: valid until
/// the map next changes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pos {
    c: usize,
    i: usize,
}

/// What [`OrdMap::around`] finds: a place and the entries before and at
/// it.
pub(crate) type Around<'a, K, V> = (Pos, Option<&'a (K, V)>, Option<&'a (K, V)>);

#[derive(Debug, Clone)]
pub(crate) struct OrdMap<K, V, const N: usize = CHUNK> {
    /// The first key of each chunk (chunks are never empty).
    firsts: Vec<K>,
    chunks: Vec<Vec<(K, V)>>,
    len: usize,
}

impl<K, V, const N: usize> Default for OrdMap<K, V, N> {
    fn default() -> Self {
        OrdMap {
            firsts: Vec::new(),
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<K: Ord + Copy, V, const N: usize> OrdMap<K, V, N> {
    /// A chunk with fewer entries than this joins a neighbour where both
    /// fit in one chunk.
    const MIN: usize = N / 4;

    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunk that holds `k` if anything does: the last one whose
    /// first key is at most `k`.
    #[inline]
    fn chunk_le(&self, k: &K) -> Option<usize> {
        self.firsts.partition_point(|f| f <= k).checked_sub(1)
    }

    /// The last chunk whose first key is below `k`.
    #[inline]
    fn chunk_lt(&self, k: &K) -> Option<usize> {
        self.firsts.partition_point(|f| f < k).checked_sub(1)
    }

    #[inline]
    fn find(&self, k: &K) -> Option<(usize, usize)> {
        let c = self.chunk_le(k)?;
        let i = self.chunks[c].binary_search_by(|e| e.0.cmp(k)).ok()?;
        Some((c, i))
    }

    // Part of the map whole, though the arena now reaches these entries
    // by place (no search of their own).
    #[allow(dead_code)]
    pub fn get(&self, k: &K) -> Option<&V> {
        let (c, i) = self.find(k)?;
        Some(&self.chunks[c][i].1)
    }

    // Part of the map whole, though the arena now reaches these entries
    // by place (no search of their own).
    #[allow(dead_code)]
    pub fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        let (c, i) = self.find(k)?;
        Some(&mut self.chunks[c][i].1)
    }

    #[cfg(test)]
    pub fn contains_key(&self, k: &K) -> bool {
        self.find(k).is_some()
    }

    /// Insert `v` under `k`; returns the value it replaces.
    pub fn insert(&mut self, k: K, v: V) -> Option<V> {
        let Some(c) = self.chunk_le(&k).or((!self.chunks.is_empty()).then_some(0)) else {
            let mut chunk = Vec::with_capacity(N + 1);
            chunk.push((k, v));
            self.firsts.push(k);
            self.chunks.push(chunk);
            self.len = 1;
            return None;
        };
        let chunk = &mut self.chunks[c];
        match chunk.binary_search_by(|e| e.0.cmp(&k)) {
            Ok(i) => return Some(std::mem::replace(&mut chunk[i].1, v)),
            Err(i) => {
                chunk.insert(i, (k, v));
                if i == 0 {
                    self.firsts[c] = k;
                }
            }
        }
        self.len += 1;
        self.split(c);
        None
    }

    /// Chunk `c`, past its size, splits in two. The test is inline: a
    /// chunk splits once in `N / 2` inserts at most, and a call for
    /// the test alone cost every insert a frame.
    #[inline]
    fn split(&mut self, c: usize) {
        if self.chunks[c].len() > N {
            self.split_chunk(c);
        }
    }

    /// [`split`](Self::split)'s rare part.
    #[cold]
    #[inline(never)]
    fn split_chunk(&mut self, c: usize) {
        let mut upper = Vec::with_capacity(N + 1);
        upper.extend(self.chunks[c].drain(N / 2..));
        self.firsts.insert(c + 1, upper[0].0);
        self.chunks.insert(c + 1, upper);
    }

    /// Move the entry of `old` to key `new`, where no other key lies
    /// between the two (its place in the order stays): no entry moves.
    /// Returns its value, or `None` (and changes nothing) where `old` has
    /// no entry.
    // Part of the map whole, though the arena now reaches these entries
    // by place (no search of their own).
    #[allow(dead_code)]
    pub fn rekey(&mut self, old: &K, new: K) -> Option<&mut V> {
        let (c, i) = self.find(old)?;
        self.rekey_entry(c, i, new)
    }

    /// Whether key `new` would sit where the entry (chunk `c`, index `i`)
    /// is: between its neighbours.
    #[inline]
    fn keeps_place(&self, c: usize, i: usize, new: &K) -> bool {
        let chunk = &self.chunks[c];
        let after_prev = match i.checked_sub(1) {
            Some(j) => chunk[j].0 < *new,
            None => c == 0 || self.chunks[c - 1].last().is_some_and(|e| e.0 < *new),
        };
        after_prev
            && match chunk.get(i + 1) {
                Some(e) => *new < e.0,
                None => self.firsts.get(c + 1).is_none_or(|f| *new < *f),
            }
    }

    /// Move the entry of `old` to key `new`, wherever that is: rewritten
    /// in place when no other key lies between the two (one search),
    /// else removed and inserted again. Returns whether `old` had an entry
    /// (nothing changes where it had none).
    pub fn move_key(&mut self, old: &K, new: K) -> bool {
        let Some((c, i)) = self.find(old) else {
            return false;
        };
        if self.keeps_place(c, i, &new) {
            if i == 0 {
                self.firsts[c] = new;
            }
            self.chunks[c][i].0 = new;
        } else {
            let (_, v) = self.remove_at(c, i);
            self.insert(new, v);
        }
        true
    }

    #[inline]
    fn rekey_entry(&mut self, c: usize, i: usize, new: K) -> Option<&mut V> {
        debug_assert!(self.keeps_place(c, i, &new), "a new key keeps its place");
        if i == 0 {
            self.firsts[c] = new;
        }
        let e = &mut self.chunks[c][i];
        e.0 = new;
        Some(&mut e.1)
    }

    /// The place of the first entry with a key at least `k` (or past the
    /// last entry): one search, after which the entries on either side of
    /// `k` are read, rewritten or joined by a new one with no other.
    #[inline]
    pub fn lower_bound(&self, k: &K) -> Pos {
        match self.chunk_le(k) {
            None => Pos { c: 0, i: 0 },
            Some(c) => Pos {
                c,
                i: self.chunks[c].partition_point(|e| e.0 < *k),
            },
        }
    }

    /// [`lower_bound`](Self::lower_bound) of `k` with the entries on either
    /// side of the place it finds (the last with a key below `k`, the
    /// first with a key at least `k`): one search for a caller that reads
    /// both. `hint` is a chunk to search from, any number: where that
    /// chunk still starts at or below `k`, the chunks before it are not
    /// looked at, so a caller going up through the map in key order keeps
    /// the one found here (it is set to it) and searches only what lies
    /// between. Any other `hint` (`usize::MAX`, or a chunk that starts
    /// above `k`) searches every chunk; the answer is the same.
    #[inline]
    pub fn around(&self, k: &K, hint: &mut usize) -> Around<'_, K, V> {
        let Some(c) = self.chunk_le_from(k, hint) else {
            return self.around_first();
        };
        let chunk = &self.chunks[c];
        let i = chunk.partition_point(|e| e.0 < *k);
        let left = match i.checked_sub(1) {
            Some(j) => chunk.get(j),
            // `k` is the chunk's first key.
            None => c.checked_sub(1).and_then(|p| self.chunks[p].last()),
        };
        let right = match chunk.get(i) {
            Some(e) => Some(e),
            None => self.chunks.get(c + 1).and_then(|n| n.first()),
        };
        (Pos { c, i }, left, right)
    }

    /// [`chunk_le`](Self::chunk_le) searched from chunk `hint` on (see
    /// [`around`](Self::around)), which is set to the chunk found (left
    /// as it was where none is).
    #[inline]
    fn chunk_le_from(&self, k: &K, hint: &mut usize) -> Option<usize> {
        let c = match self.firsts.get(*hint..) {
            Some([f, rest @ ..]) if *f <= *k => match rest.first() {
                // The next key is in the same chunk or the one after, as
                // it is for blocks of a batch, mostly.
                Some(n) if *n <= *k => *hint + 1 + rest[1..].partition_point(|f| f <= k),
                _ => *hint,
            },
            _ => self.chunk_le(k)?,
        };
        *hint = c;
        Some(c)
    }

    /// [`lower_bound`](Self::lower_bound) searched from chunk `hint` on
    /// (see [`around`](Self::around)), which is set to the chunk found:
    /// the same place, whatever `hint` is.
    #[inline]
    pub fn lower_bound_from(&self, k: &K, hint: &mut usize) -> Pos {
        match self.chunk_le_from(k, hint) {
            None => Pos { c: 0, i: 0 },
            Some(c) => Pos {
                c,
                i: self.chunks[c].partition_point(|e| e.0 < *k),
            },
        }
    }

    /// [`around`](Self::around) of a key below every key (or in an empty
    /// map).
    #[cold]
    fn around_first(&self) -> Around<'_, K, V> {
        let right = self.chunks.first().and_then(|c| c.first());
        (Pos { c: 0, i: 0 }, None, right)
    }

    /// `pos` as (chunk, index) of an entry, if one is at or after it.
    #[inline]
    fn entry_at(&self, pos: Pos) -> Option<(usize, usize)> {
        let chunk = self.chunks.get(pos.c)?;
        if pos.i < chunk.len() {
            Some((pos.c, pos.i))
        } else {
            (pos.c + 1 < self.chunks.len()).then_some((pos.c + 1, 0))
        }
    }

    /// The entry before `pos` as (chunk, index), if any.
    #[inline]
    fn entry_before(&self, pos: Pos) -> Option<(usize, usize)> {
        if pos.i > 0 {
            Some((pos.c, pos.i - 1))
        } else if pos.c > 0 {
            Some((pos.c - 1, self.chunks[pos.c - 1].len() - 1))
        } else {
            None
        }
    }

    /// The place of the entry before `pos`, if any.
    #[inline]
    pub fn pos_before(&self, pos: Pos) -> Option<Pos> {
        let (c, i) = self.entry_before(pos)?;
        Some(Pos { c, i })
    }

    /// The entry at `pos` (the first with a key at least the one searched).
    #[inline]
    pub fn at(&self, pos: Pos) -> Option<(K, &V)> {
        let (c, i) = self.entry_at(pos)?;
        let e = &self.chunks[c][i];
        Some((e.0, &e.1))
    }

    /// The entry before `pos` (the last with a key below the one searched).
    #[inline]
    pub fn before(&self, pos: Pos) -> Option<(K, &V)> {
        let (c, i) = self.entry_before(pos)?;
        let e = &self.chunks[c][i];
        Some((e.0, &e.1))
    }

    /// The value of the entry at `pos`, mutable.
    #[inline]
    pub fn at_mut(&mut self, pos: Pos) -> Option<&mut V> {
        let (c, i) = self.entry_at(pos)?;
        Some(&mut self.chunks[c][i].1)
    }

    /// The entry after the one at `pos`.
    #[inline]
    pub fn after(&self, pos: Pos) -> Option<(K, &V)> {
        let (c, i) = self.entry_at(pos)?;
        let e = match self.chunks[c].get(i + 1) {
            Some(e) => e,
            None => self.chunks.get(c + 1)?.first()?,
        };
        Some((e.0, &e.1))
    }

    /// Remove the entry at `pos` (no search); returns it.
    pub fn remove_at_pos(&mut self, pos: Pos) -> Option<(K, V)> {
        let (c, i) = self.entry_at(pos)?;
        Some(self.remove_at(c, i))
    }

    /// The place of the entry after the one at `pos`.
    #[inline]
    pub fn pos_after(&self, pos: Pos) -> Pos {
        match self.entry_at(pos) {
            Some((c, i)) => Pos { c, i: i + 1 },
            None => pos,
        }
    }

    /// Remove the entry at `pos` (no search); returns it and the place of
    /// the entry that followed it. That place is found with no search
    /// unless the entry's chunk became short enough to join a neighbour.
    #[inline]
    pub fn remove_at_pos_then(&mut self, pos: Pos) -> Option<((K, V), Pos)> {
        let (c, i) = self.entry_at(pos)?;
        let reshapes = self.chunks[c].len() <= Self::MIN;
        let e = self.remove_at(c, i);
        let next = if reshapes {
            self.lower_bound(&e.0)
        } else {
            Pos { c, i }
        };
        Some((e, next))
    }

    /// Remove the entry before `pos` (no search); returns it.
    pub fn remove_before(&mut self, pos: Pos) -> Option<(K, V)> {
        let (c, i) = self.entry_before(pos)?;
        Some(self.remove_at(c, i))
    }

    /// The entry at exactly `pos` (a place handed out before the map
    /// changed), if it still holds one: unlike [`at`](Self::at), never the
    /// next chunk's first entry where the chunk has got shorter, so that
    /// the neighbours of the place are those of the entry.
    #[inline]
    pub fn at_place(&self, pos: Pos) -> Option<(K, &V)> {
        let e = self.chunks.get(pos.c)?.get(pos.i)?;
        Some((e.0, &e.1))
    }

    /// Remove the entry after the one at `pos` (no search); returns it.
    pub fn remove_after(&mut self, pos: Pos) -> Option<(K, V)> {
        let (c, i) = self.entry_at(pos)?;
        let (c, i) = if i + 1 < self.chunks[c].len() {
            (c, i + 1)
        } else {
            (c + 1, 0)
        };
        // Chunks are never empty: the next chunk, if any, has a first entry.
        (c < self.chunks.len()).then(|| self.remove_at(c, i))
    }

    /// Remove the entry at `pos` and the one after it (no search); false
    /// (nothing removed) unless both are there.
    pub fn remove_two_at(&mut self, pos: Pos) -> bool {
        let Some((c, i)) = self.entry_at(pos) else {
            return false;
        };
        if i + 2 <= self.chunks[c].len() {
            let chunk = &mut self.chunks[c];
            chunk.drain(i..i + 2);
            self.len -= 2;
            let n = chunk.len();
            if n > 0 && i == 0 {
                self.firsts[c] = chunk[0].0;
            }
            if n < Self::MIN {
                self.shrunk(c);
            }
        } else {
            if c + 1 >= self.chunks.len() {
                return false;
            }
            // The later one first: removing the first entry of chunk
            // `c + 1` leaves the entries of chunk `c` where they are (a
            // short chunk joins the next one, or is appended to `c`).
            self.remove_at(c + 1, 0);
            self.remove_at(c, i);
        }
        true
    }

    /// The value of the entry before `pos`, mutable.
    #[inline]
    pub fn before_mut(&mut self, pos: Pos) -> Option<&mut V> {
        let (c, i) = self.entry_before(pos)?;
        Some(&mut self.chunks[c][i].1)
    }

    /// [`rekey`](Self::rekey) of the entry at `pos`.
    #[inline]
    pub fn rekey_at(&mut self, pos: Pos, new: K) -> Option<&mut V> {
        let (c, i) = self.entry_at(pos)?;
        self.rekey_entry(c, i, new)
    }

    /// [`rekey`](Self::rekey) of the entry before `pos`.
    #[inline]
    pub fn rekey_before(&mut self, pos: Pos, new: K) -> Option<&mut V> {
        let (c, i) = self.entry_before(pos)?;
        self.rekey_entry(c, i, new)
    }

    /// Insert `k` at `pos`, between the entries before and at it (the
    /// caller's promise, checked in debug builds): no search. Inline, as
    /// is [`remove_at`](Self::remove_at): the arena's updates are a few
    /// moves each, which a call frame would double.
    #[inline]
    pub fn insert_at(&mut self, pos: Pos, k: K, v: V) {
        debug_assert!(
            self.before(pos).is_none_or(|(b, _)| b < k) && self.at(pos).is_none_or(|(a, _)| k < a),
            "an entry inserted at its place"
        );
        let Pos { c, i } = pos;
        match self.chunks.get_mut(c) {
            Some(chunk) => {
                chunk.insert(i, (k, v));
                if i == 0 {
                    self.firsts[c] = k;
                }
                self.len += 1;
                self.split(c);
            }
            None => self.first_entry(k, v),
        }
    }

    /// The entry of an empty map.
    #[cold]
    #[inline(never)]
    fn first_entry(&mut self, k: K, v: V) {
        assert!(self.chunks.is_empty(), "an entry inserted at its place");
        let mut chunk = Vec::with_capacity(N + 1);
        chunk.push((k, v));
        self.firsts.push(k);
        self.chunks.push(chunk);
        self.len = 1;
    }

    /// Remove the entry of `k`; returns its value.
    pub fn remove(&mut self, k: &K) -> Option<V> {
        let (c, i) = self.find(k)?;
        Some(self.remove_at(c, i).1)
    }

    #[inline]
    fn remove_at(&mut self, c: usize, i: usize) -> (K, V) {
        let chunk = &mut self.chunks[c];
        let e = chunk.remove(i);
        self.len -= 1;
        let n = chunk.len();
        if n > 0 && i == 0 {
            self.firsts[c] = chunk[0].0;
        }
        if n < Self::MIN {
            self.shrunk(c);
        }
        e
    }

    /// Chunk `c`, short after a remove: it goes where empty, else it
    /// joins a neighbour where both fit in one chunk.
    #[inline(never)]
    fn shrunk(&mut self, c: usize) {
        if self.chunks[c].is_empty() {
            self.chunks.remove(c);
            self.firsts.remove(c);
        } else {
            self.join(c);
        }
    }

    /// Chunk `c`, short, joins a neighbour where both fit in one chunk.
    fn join(&mut self, c: usize) {
        let n = self.chunks[c].len();
        if c + 1 < self.chunks.len() && n + self.chunks[c + 1].len() <= N {
            let next = self.chunks.remove(c + 1);
            self.firsts.remove(c + 1);
            self.chunks[c].extend(next);
        } else if c > 0 && n + self.chunks[c - 1].len() <= N {
            let this = self.chunks.remove(c);
            self.firsts.remove(c);
            self.chunks[c - 1].extend(this);
        }
    }

    /// The entry with the largest key at most `k` (`range(..=k).next_back()`).
    #[inline]
    pub fn last_le(&self, k: &K) -> Option<(K, &V)> {
        let c = self.chunk_le(k)?;
        let chunk = &self.chunks[c];
        let i = chunk.partition_point(|e| e.0 <= *k);
        let e = &chunk[i - 1];
        Some((e.0, &e.1))
    }

    /// [`last_le`](Self::last_le), the value mutable.
    #[inline]
    #[cfg(test)]
    pub fn last_le_mut(&mut self, k: &K) -> Option<(K, &mut V)> {
        let c = self.chunk_le(k)?;
        let chunk = &mut self.chunks[c];
        let i = chunk.partition_point(|e| e.0 <= *k);
        let e = &mut chunk[i - 1];
        Some((e.0, &mut e.1))
    }

    /// The entry with the largest key below `k` (`range(..k).next_back()`).
    #[inline]
    // Part of the map whole, though the arena now reaches these entries
    // by place (no search of their own).
    #[allow(dead_code)]
    pub fn last_lt(&self, k: &K) -> Option<(K, &V)> {
        let c = self.chunk_lt(k)?;
        let chunk = &self.chunks[c];
        let i = chunk.partition_point(|e| e.0 < *k);
        let e = &chunk[i - 1];
        Some((e.0, &e.1))
    }

    /// [`last_lt`](Self::last_lt), the value mutable.
    #[inline]
    // Part of the map whole, though the arena now reaches these entries
    // by place (no search of their own).
    #[allow(dead_code)]
    pub fn last_lt_mut(&mut self, k: &K) -> Option<(K, &mut V)> {
        let c = self.chunk_lt(k)?;
        let chunk = &mut self.chunks[c];
        let i = chunk.partition_point(|e| e.0 < *k);
        let e = &mut chunk[i - 1];
        Some((e.0, &mut e.1))
    }

    /// The entry with the smallest key.
    #[cfg(test)]
    pub fn first(&self) -> Option<(K, &V)> {
        let e = self.chunks.first()?.first()?;
        Some((e.0, &e.1))
    }

    /// The entry with the largest key.
    #[cfg(test)]
    pub fn last(&self) -> Option<(K, &V)> {
        let e = self.chunks.last()?.last()?;
        Some((e.0, &e.1))
    }

    /// Every entry, in key order.
    pub fn iter(&self) -> Iter<'_, K, V, N> {
        Iter {
            map: self,
            c: 0,
            i: 0,
        }
    }

    /// The entries with keys at least `k`, in key order.
    pub fn iter_from(&self, k: &K) -> Iter<'_, K, V, N> {
        let (c, i) = match self.chunk_le(k) {
            None => (0, 0),
            Some(c) => (c, self.chunks[c].partition_point(|e| e.0 < *k)),
        };
        Iter { map: self, c, i }
    }

    /// The first entry from key `k` on for which `f` says `Break`, and
    /// what it said: [`iter_from`](Self::iter_from) with `find_map`, as a
    /// loop over each chunk's slice (no per-entry chunk bounds check), for
    /// long walks.
    #[cfg(test)]
    pub fn scan_from<R>(
        &self,
        k: &K,
        f: impl FnMut(K, &V) -> std::ops::ControlFlow<R>,
    ) -> Option<R> {
        self.scan_from_pos(k, f).map(|(r, _)| r)
    }

    /// `scan_from` (kept for the tests), with the place just past the entry
    /// where `f` said `Break` (the one [`lower_bound`](Self::lower_bound)
    /// finds for any key above the entry's and up to the next key's), so
    /// that the entry found is then rewritten with no search.
    #[cfg(test)]
    pub fn scan_from_pos<R>(
        &self,
        k: &K,
        f: impl FnMut(K, &V) -> std::ops::ControlFlow<R>,
    ) -> Option<(R, Pos)> {
        self.scan_at(self.lower_bound(k), f)
    }

    /// The first entry from `pos` on (a place found by
    /// [`lower_bound`](Self::lower_bound)) for which `f` says `Break`, what
    /// it said and the place just past that entry: a loop over each
    /// chunk's slice (no per-entry chunk bounds check), with no search.
    #[inline]
    #[allow(dead_code)]
    pub fn scan_at<R>(
        &self,
        pos: Pos,
        mut f: impl FnMut(K, &V) -> std::ops::ControlFlow<R>,
    ) -> Option<(R, Pos)> {
        let Pos { c, mut i } = pos;
        for (d, chunk) in self.chunks.get(c..).unwrap_or_default().iter().enumerate() {
            for (j, e) in chunk.get(i..).unwrap_or_default().iter().enumerate() {
                if let std::ops::ControlFlow::Break(r) = f(e.0, &e.1) {
                    let past = Pos {
                        c: c + d,
                        i: i + j + 1,
                    };
                    return Some((r, past));
                }
            }
            i = 0;
        }
        None
    }

    /// [`scan_at`](Self::scan_at) over the entries with keys at most
    /// `last` alone, so that `f` need not test the key of each entry (see
    /// [`scan_past_places_upto_at`](Self::scan_past_places_upto_at)).
    /// `None` where `f` said `Break` to none of them.
    #[inline]
    pub fn scan_upto_at<R>(
        &self,
        pos: Pos,
        last: &K,
        mut f: impl FnMut(K, &V) -> std::ops::ControlFlow<R>,
    ) -> Option<(R, Pos)> {
        self.scan_past_places_upto_at(pos, last, |past, k, v| match f(k, v) {
            std::ops::ControlFlow::Break(r) => std::ops::ControlFlow::Break((r, past)),
            std::ops::ControlFlow::Continue(()) => std::ops::ControlFlow::Continue(()),
        })
    }

    /// [`scan_upto_at`](Self::scan_upto_at) where `f` is also given the
    /// place just past each entry: a scan that settles on an entry before
    /// the one it stops at hands that entry's place on, and it is then
    /// rewritten with no search. A chunk whose last key is at most `last`
    /// is walked with no test of the keys; in the one where the keys pass
    /// `last` each key is tested, which costs less than a search for the
    /// cut where few of its entries are walked. Each chunk is walked as a
    /// slice iterator (no bounds check per entry), its place read from
    /// what the iterator has left.
    #[inline]
    pub fn scan_past_places_upto_at<R>(
        &self,
        pos: Pos,
        last: &K,
        mut f: impl FnMut(Pos, K, &V) -> std::ops::ControlFlow<R>,
    ) -> Option<R> {
        let Pos { c, mut i } = pos;
        for (d, chunk) in self.chunks.get(c..).unwrap_or_default().iter().enumerate() {
            let n = chunk.len();
            let mut todo = chunk.get(i..).unwrap_or_default().iter();
            if chunk.last().is_some_and(|e| e.0 <= *last) {
                while let Some(e) = todo.next() {
                    let past = Pos {
                        c: c + d,
                        i: n - todo.len(),
                    };
                    if let std::ops::ControlFlow::Break(r) = f(past, e.0, &e.1) {
                        return Some(r);
                    }
                }
            } else {
                // The chunk where the keys pass `last`: the last one
                // walked, each key tested.
                while let Some(e) = todo.next() {
                    if e.0 > *last {
                        break;
                    }
                    let past = Pos {
                        c: c + d,
                        i: n - todo.len(),
                    };
                    if let std::ops::ControlFlow::Break(r) = f(past, e.0, &e.1) {
                        return Some(r);
                    }
                }
                return None;
            }
            i = 0;
        }
        None
    }

    /// [`scan_at`](Self::scan_at), `f` also given each entry's place (the
    /// one [`lower_bound`](Self::lower_bound) finds for its key): valid
    /// until the map next changes.
    #[inline]
    pub fn scan_places_at<R>(
        &self,
        pos: Pos,
        mut f: impl FnMut(Pos, K, &V) -> std::ops::ControlFlow<R>,
    ) -> Option<R> {
        let Pos { c, mut i } = pos;
        for (d, chunk) in self.chunks.get(c..).unwrap_or_default().iter().enumerate() {
            for (j, e) in chunk.get(i..).unwrap_or_default().iter().enumerate() {
                let at = Pos { c: c + d, i: i + j };
                if let std::ops::ControlFlow::Break(r) = f(at, e.0, &e.1) {
                    return Some(r);
                }
            }
            i = 0;
        }
        None
    }

    /// The entries with keys in `[lo, hi)`, in key order.
    pub fn range(&self, lo: K, hi: K) -> impl Iterator<Item = (K, &V)> + '_ {
        self.iter_from(&lo).take_while(move |e| e.0 < hi)
    }

    /// The entries with keys below `k`, largest key first.
    pub fn iter_rev_lt(&self, k: &K) -> RevIter<'_, K, V, N> {
        match self.chunk_lt(k) {
            None => RevIter {
                map: self,
                c: 0,
                i: 0,
            },
            Some(c) => RevIter {
                map: self,
                c,
                i: self.chunks[c].partition_point(|e| e.0 < *k),
            },
        }
    }
}

/// Entries in key order (see [`OrdMap::iter_from`]).
pub(crate) struct Iter<'a, K, V, const N: usize = CHUNK> {
    map: &'a OrdMap<K, V, N>,
    c: usize,
    i: usize,
}

impl<'a, K: Copy, V, const N: usize> Iterator for Iter<'a, K, V, N> {
    type Item = (K, &'a V);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let chunk = self.map.chunks.get(self.c)?;
            if let Some(e) = chunk.get(self.i) {
                self.i += 1;
                return Some((e.0, &e.1));
            }
            self.c += 1;
            self.i = 0;
        }
    }
}

/// Entries in reverse key order (see [`OrdMap::iter_rev_lt`]).
pub(crate) struct RevIter<'a, K, V, const N: usize = CHUNK> {
    map: &'a OrdMap<K, V, N>,
    /// The chunk of the next entry, whose index is `i - 1` there.
    c: usize,
    i: usize,
}

impl<'a, K: Copy, V, const N: usize> Iterator for RevIter<'a, K, V, N> {
    type Item = (K, &'a V);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.i > 0 {
                self.i -= 1;
                let e = &self.map.chunks[self.c][self.i];
                return Some((e.0, &e.1));
            }
            if self.c == 0 {
                return None;
            }
            self.c -= 1;
            self.i = self.map.chunks[self.c].len();
        }
    }
}

impl<const N: usize> OrdMap<usize, usize, N> {
    /// For a map of spans (start → length), where `[off, off + len)` would
    /// go: its position, the span ending exactly at `off` (start, length)
    /// and the length of the span starting exactly at `off + len`, the
    /// neighbours it would merge with.
    pub fn touching(&self, off: usize, len: usize) -> (Pos, Option<(usize, usize)>, Option<usize>) {
        let pos = self.lower_bound(&off);
        let left = self
            .before(pos)
            .filter(|&(lo, &ll)| lo + ll == off)
            .map(|(lo, &ll)| (lo, ll));
        let right = self
            .at(pos)
            .filter(|&(ro, _)| ro == off + len)
            .map(|(_, &rl)| rl);
        (pos, left, right)
    }

    /// [`touching`](Self::touching), searched from chunk `hint` on (see
    /// [`around`](Self::around), which sets it to the chunk found).
    #[inline]
    pub fn touching_from(
        &self,
        off: usize,
        len: usize,
        hint: &mut usize,
    ) -> (Pos, Option<(usize, usize)>, Option<usize>) {
        let (pos, left, right) = self.around(&off, hint);
        let left = left.filter(|&&(lo, ll)| lo + ll == off).copied();
        let right = right.filter(|&&(ro, _)| ro == off + len).map(|&(_, rl)| rl);
        (pos, left, right)
    }
}

impl<K: Ord + Copy, V: PartialEq, const N: usize> PartialEq for OrdMap<K, V, N> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

#[cfg(test)]
impl<K: Ord + Copy, V, const N: usize> OrdMap<K, V, N> {
    /// Check the chunks' invariants (tests only).
    pub fn check(&self) {
        assert_eq!(self.firsts.len(), self.chunks.len());
        let mut n = 0;
        let mut prev: Option<K> = None;
        for (f, c) in self.firsts.iter().zip(&self.chunks) {
            assert!(!c.is_empty() && c.len() <= N, "chunk size");
            assert!(*f == c[0].0, "first key");
            for e in c {
                assert!(prev.is_none_or(|p| p < e.0), "keys in order");
                prev = Some(e.0);
            }
            n += c.len();
        }
        assert_eq!(n, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn agrees_with_a_btree_map() {
        agrees_with_a_btree_map_in_chunks_of::<CHUNK>();
    }

    /// The same with chunks of the free map's size, where chunks split
    /// and join twice as often.
    #[test]
    fn agrees_with_a_btree_map_in_short_chunks() {
        agrees_with_a_btree_map_in_chunks_of::<16>();
    }

    fn agrees_with_a_btree_map_in_chunks_of<const N: usize>() {
        let mut map: OrdMap<u32, u32, N> = OrdMap::new();
        let mut model: BTreeMap<u32, u32> = BTreeMap::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..60_000u32 {
            // Phases of growth and of shrinking, so chunks split and join.
            let grow = (step / 5_000) % 2 == 0;
            let r = rnd();
            let k = (r % 2_000) as u32;
            match r >> 60 {
                0..=8 if grow => assert_eq!(map.insert(k, step), model.insert(k, step)),
                0..=3 => assert_eq!(map.insert(k, step), model.insert(k, step)),
                _ => assert_eq!(map.remove(&k), model.remove(&k)),
            }
            let q = (rnd() % 2_100) as u32;
            let kv = |e: Option<(&u32, &u32)>| e.map(|(&k, &v)| (k, v));
            let mine = |e: Option<(u32, &u32)>| e.map(|(k, &v)| (k, v));
            assert_eq!(mine(map.last_le(&q)), kv(model.range(..=q).next_back()));
            assert_eq!(mine(map.last_lt(&q)), kv(model.range(..q).next_back()));
            assert_eq!(map.get(&q), model.get(&q));
            assert_eq!(map.contains_key(&q), model.contains_key(&q));
            if let Some((k, v)) = map.last_le_mut(&q) {
                *v += 1;
                *model.get_mut(&k).unwrap() += 1;
            }
            if let Some((k, v)) = map.last_lt_mut(&q) {
                *v += 1;
                *model.get_mut(&k).unwrap() += 1;
            }
            // Through a place: the neighbours of `q`, and an insert there.
            let pos = map.lower_bound(&q);
            assert_eq!(mine(map.at(pos)), kv(model.range(q..).next()));
            assert_eq!(mine(map.before(pos)), kv(model.range(..q).next_back()));
            assert_eq!(mine(map.after(pos)), kv(model.range(q..).nth(1)));
            // The same place and neighbours from any chunk to start at.
            let mut hint = match step % 3 {
                0 => usize::MAX,
                _ => (rnd() % 40) as usize,
            };
            let (p2, l2, r2) = map.around(&q, &mut hint);
            let pair = |e: Option<&(u32, u32)>| e.map(|&(k, v)| (k, v));
            assert_eq!(pair(l2), kv(model.range(..q).next_back()));
            assert_eq!(pair(r2), kv(model.range(q..).next()));
            assert_eq!(mine(map.before(p2)), pair(l2));
            assert_eq!(mine(map.at(p2)), pair(r2));
            // The place alone, from any chunk to start at: the one
            // `lower_bound` finds.
            let mut hint = (rnd() % 40) as usize;
            let p3 = map.lower_bound_from(&q, &mut hint);
            assert_eq!((p3.c, p3.i), (pos.c, pos.i));
            if step % 7 == 4 {
                if let Some(v) = map.at_mut(pos) {
                    *v += 5;
                    *model.range_mut(q..).next().unwrap().1 += 5;
                }
            } else if step % 7 == 6 && !grow {
                let mine = map.remove_at_pos(pos);
                let first = model.range(q..).next().map(|(&k, _)| k);
                assert_eq!(mine, first.map(|k| (k, model.remove(&k).unwrap())));
                continue;
            } else if step % 7 == 3 && !grow {
                // Removed at its place: the place handed back is that of
                // the entry after it.
                let first = model.range(q..).next().map(|(&k, _)| k);
                let got = map.remove_at_pos_then(pos);
                let want = first.map(|k| (k, model.remove(&k).unwrap()));
                assert_eq!(got.map(|m| m.0), want);
                if let Some((_, next)) = got {
                    let after = want.and_then(|(k, _)| model.range(k..).next());
                    assert_eq!(mine(map.at(next)), kv(after));
                    let past = map.pos_after(next);
                    let later = after.and_then(|(&k, _)| model.range(k + 1..).next());
                    assert_eq!(mine(map.at(past)), kv(later));
                }
                continue;
            } else if step % 7 == 5 && !grow {
                let mine = map.remove_before(pos);
                let last = model.range(..q).next_back().map(|(&k, _)| k);
                assert_eq!(mine, last.map(|k| (k, model.remove(&k).unwrap())));
                continue;
            }
            if step % 5 == 0 && !model.contains_key(&q) {
                map.insert_at(pos, q, step);
                model.insert(q, step);
            } else if step % 5 == 1 {
                if let Some(v) = map.before_mut(pos) {
                    *v += 3;
                    *model.range_mut(..q).next_back().unwrap().1 += 3;
                }
            } else if step % 5 == 2 {
                // The entry at the place moves down to `q` where free.
                if let Some((&a, _)) = model.range(q..).next() {
                    if a != q {
                        let v = map.rekey_at(pos, q).map(|v| *v);
                        let m = model.remove(&a).unwrap();
                        model.insert(q, m);
                        assert_eq!(v, Some(m));
                    }
                }
            } else if step % 5 == 3 {
                // The entry before the place moves up to `q - 1`.
                if let Some((&b, _)) = model.range(..q).next_back() {
                    if b + 1 < q {
                        let v = map.rekey_before(pos, q - 1).map(|v| *v);
                        let m = model.remove(&b).unwrap();
                        model.insert(q - 1, m);
                        assert_eq!(v, Some(m));
                    }
                }
            }
            // Move a key anywhere free.
            if step % 11 == 3 {
                let to = (rnd() % 2_000) as u32;
                if let Some((k, _)) = map.last_le(&q).filter(|_| !model.contains_key(&to)) {
                    assert!(map.move_key(&k, to));
                    let m = model.remove(&k).unwrap();
                    model.insert(to, m);
                }
                assert!(!map.move_key(&5_000, 5_001));
            }
            // Move a key up to just below the next one, or down to just
            // above the previous one.
            if let Some((k, _)) = map.last_le(&q) {
                let next = model.range(k + 1..).next().map_or(k + 7, |(&n, _)| n);
                let prev = model.range(..k).next_back().map_or(0, |(&p, _)| p + 1);
                let to = if step % 2 == 0 {
                    next - 1
                } else {
                    prev.max(k.saturating_sub(3))
                };
                let v = map.rekey(&k, to).map(|v| *v);
                let m = model.remove(&k).unwrap();
                model.insert(to, m);
                assert_eq!(v, Some(m));
            }
            if step % 97 == 0 {
                let hi = q + (rnd() % 300) as u32;
                assert!(map
                    .range(q, hi)
                    .map(|(k, &v)| (k, v))
                    .eq(model.range(q..hi).map(|(&k, &v)| (k, v))));
                assert!(map
                    .iter_rev_lt(&q)
                    .map(|(k, &v)| (k, v))
                    .eq(model.range(..q).rev().map(|(&k, &v)| (k, v))));
                assert!(map
                    .iter_from(&q)
                    .map(|(k, &v)| (k, v))
                    .eq(model.range(q..).map(|(&k, &v)| (k, v))));
                // The first entry from q on whose value is divisible by
                // 3, or none: the scan agrees with the model, and the
                // entries it visited are those before it, in order.
                let mut seen = Vec::new();
                let found = map.scan_from(&q, |k, &v| {
                    seen.push(k);
                    if v % 3 == 0 {
                        std::ops::ControlFlow::Break((k, v))
                    } else {
                        std::ops::ControlFlow::Continue(())
                    }
                });
                let want = model.range(q..).find(|(_, &v)| v % 3 == 0);
                assert_eq!(found, kv(want));
                // Each place handed out lies just past its entry: the
                // entry is the one before it, the next key the one at it.
                let found_pos = map.scan_from_pos(&q, |k, &v| {
                    if v % 3 == 0 {
                        std::ops::ControlFlow::Break((k, v))
                    } else {
                        std::ops::ControlFlow::Continue(())
                    }
                });
                assert_eq!(found_pos.map(|f| f.0), kv(want));
                if let Some(((k, v), past)) = found_pos {
                    assert_eq!(map.before(past).map(|(b, &w)| (b, w)), Some((k, v)));
                    let next = model.range(k + 1..).next();
                    assert_eq!(map.at(past).map(|(a, &w)| (a, w)), kv(next));
                }
                // The same over the keys up to a bound alone: the scan
                // stops at the bound, and each place handed to `f` lies
                // just past its entry.
                let last = q + (rnd() % 400) as u32;
                let upto = map.scan_upto_at(map.lower_bound(&q), &last, |k, &v| {
                    if v % 3 == 0 {
                        std::ops::ControlFlow::Break((k, v))
                    } else {
                        std::ops::ControlFlow::Continue(())
                    }
                });
                let want_upto = model.range(q..=last).find(|(_, &v)| v % 3 == 0);
                assert_eq!(upto.map(|u| u.0), kv(want_upto));
                if let Some(((k, v), past)) = upto {
                    assert_eq!(map.before(past).map(|(b, &w)| (b, w)), Some((k, v)));
                }
                let mut places = Vec::new();
                let none: Option<()> =
                    map.scan_past_places_upto_at(map.lower_bound(&q), &u32::MAX, |p, k, _| {
                        places.push((k, map.before(p).map(|(b, _)| b)));
                        std::ops::ControlFlow::Continue(())
                    });
                assert!(none.is_none());
                assert!(places
                    .iter()
                    .copied()
                    .eq(model.range(q..).map(|(&k, _)| (k, Some(k)))));
                assert!(seen.iter().copied().eq(model
                    .range(q..)
                    .map(|(&k, _)| k)
                    .take_while(|&k| want.is_none_or(|(&w, _)| k <= w))));
                assert_eq!(map.first().map(|(k, &v)| (k, v)), kv(model.iter().next()));
                assert_eq!(
                    map.last().map(|(k, &v)| (k, v)),
                    kv(model.iter().next_back())
                );
                assert_eq!(map.len(), model.len());
                map.check();
            }
        }
        assert!(map
            .iter()
            .map(|(k, &v)| (k, v))
            .eq(model.iter().map(|(&k, &v)| (k, v))));
    }

    /// Spans given back in address order, each searched for from the
    /// chunk where the last one went, while the map grows and shrinks
    /// between them (chunks split and join, so the chunk numbers move):
    /// every search finds what a search of the whole map finds.
    #[test]
    fn touching_from_a_carried_hint() {
        let mut map: OrdMap<usize, usize> = OrdMap::new();
        let mut model: BTreeMap<usize, usize> = BTreeMap::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..300 {
            // Spans of one byte at even keys, some of them.
            for _ in 0..40 {
                let k = (rnd() % 4_000) as usize * 2;
                map.insert(k, 1);
                model.insert(k, 1);
            }
            let mut hint = if round % 2 == 0 { usize::MAX } else { 0 };
            let mut off = (rnd() % 50) as usize;
            while off < 8_000 {
                let len = 1 + (rnd() % 3) as usize;
                if model.range(off..off + len).next().is_some() {
                    // Bytes in a span: not given back.
                    off += len;
                    continue;
                }
                let (pos, left, right) = map.touching_from(off, len, &mut hint);
                let want_left = model
                    .range(..off)
                    .next_back()
                    .filter(|(&o, &l)| o + l == off)
                    .map(|(&o, &l)| (o, l));
                let want_right = model.get(&(off + len)).copied();
                assert_eq!((left, right), (want_left, want_right));
                assert_eq!(
                    map.at(pos).map(|(k, &v)| (k, v)),
                    model.range(off..).next().map(|(&k, &v)| (k, v))
                );
                // Change the map around the place: an entry in, or the one
                // at the place out (the chunks move under the hint).
                if rnd() % 2 == 0 && !model.contains_key(&off) {
                    map.insert_at(pos, off, 1);
                    model.insert(off, 1);
                } else if let Some((k, _)) = map.remove_at_pos(pos) {
                    model.remove(&k);
                }
                off += len + (rnd() % 40) as usize;
            }
            map.check();
        }
        assert_eq!(map.len(), model.len());
    }

    /// The removals by place of the entry after a place and of two
    /// entries at once, and the places a scan hands out, against a model,
    /// across chunk boundaries and joins.
    #[test]
    fn removals_by_place_and_scanned_places_agree_with_a_btree_map() {
        removals_by_place_agree_in_chunks_of::<CHUNK>();
    }

    /// The same with chunks of the free map's size.
    #[test]
    fn removals_by_place_agree_in_short_chunks() {
        removals_by_place_agree_in_chunks_of::<16>();
    }

    fn removals_by_place_agree_in_chunks_of<const N: usize>() {
        let mut map: OrdMap<u32, u32, N> = OrdMap::new();
        let mut model: BTreeMap<u32, u32> = BTreeMap::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..40_000u32 {
            let grow = (step / 3_000) % 2 == 0;
            let r = rnd();
            let k = (r % 1_500) as u32;
            if grow || r >> 62 == 0 {
                map.insert(k, step);
                model.insert(k, step);
            }
            let q = (rnd() % 1_600) as u32;
            let pos = map.lower_bound(&q);
            let after: Vec<u32> = model.range(q..).take(2).map(|(&k, _)| k).collect();
            match step % 3 {
                0 => {
                    let mine = map.remove_after(pos);
                    let want = after.get(1).map(|&k| (k, model.remove(&k).unwrap()));
                    assert_eq!(mine, want);
                }
                1 => {
                    let removed = map.remove_two_at(pos);
                    assert_eq!(removed, after.len() == 2);
                    if removed {
                        for k in &after {
                            model.remove(k);
                        }
                    }
                }
                _ => {
                    // Every place a scan gives holds its entry.
                    let mut n = 0;
                    let _ = map.scan_places_at(map.lower_bound(&0), |at, k, &v| {
                        assert_eq!(map.at(at), Some((k, &v)));
                        assert_eq!(map.at_place(at), Some((k, &v)));
                        let found = map.lower_bound(&k);
                        assert_eq!((found.c, found.i), (at.c, at.i));
                        n += 1;
                        std::ops::ControlFlow::<()>::Continue(())
                    });
                    assert_eq!(n, model.len());
                }
            }
            if step % 50 == 0 {
                map.check();
                assert!(map
                    .iter()
                    .map(|(k, &v)| (k, v))
                    .eq(model.iter().map(|(&k, &v)| (k, v))));
            }
        }
    }
}
