//! Where a released pick may be placed (late binding): the endpoints with
//! room now, and which others are close enough to count.
